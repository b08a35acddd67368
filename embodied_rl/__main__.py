"""`python -m embodied_rl <command> ...`: the `embodied-rl` script, also under torchrun
(`torchrun --nproc-per-node=K -m embodied_rl finetune ...`)."""

import sys

from embodied_rl.cli import main

sys.exit(main())
