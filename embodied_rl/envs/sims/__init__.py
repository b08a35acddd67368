"""Code that runs inside a simulator's own interpreter, in the process backend's workers
(embodied_rl/envs/backends/process.py): a file here imports only the standard library, numpy and
its simulator, never torch or the rest of this package, because that interpreter (another venv)
has neither. The parent names such a file to the worker by its path (`factory="<file>.py:attr"`).
"""
