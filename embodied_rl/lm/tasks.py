"""Verifiable language tasks, generated on the fly: problems, worked answers and rewards.

A task makes `Problem`s (a prompt, the worked answer a supervised model is trained on, and what
the reward needs to check a completion) from a seed. Every problem has a canonical key; its hash
puts it in the train or the test split, so the splits are disjoint whatever the seed and a model
never trains on a held-out problem. A reward maps (problem, completion text) to 1.0 for a correct
answer and 0.0 for a wrong or malformed one, and never raises.

- `lm/addition`: "a+b=" -> "c", operands with 1..digits digits.
- `lm/countdown`: "46 from 3,7,25:" -> an expression over the given numbers (each at most once,
  + - * / and parentheses) whose value is the target; parsed with `ast` and evaluated exactly
  with fractions, never with eval().

Hints (Scaf-GRPO, `algo=scaf_grpo`; `lm.sft_hints` teaches a model to read them): a task has
`hint_tiers` tiers of in-prompt hints, from the most abstract (tier 1) to the most concrete,
each including the ones before it; `hinted_prompt(problem, tier)` puts the hint before the
prompt, so the tokens that precede the answer are the unhinted prompt's.
- addition: 1 the carry pattern ("c011": a carry out of each column, most significant first),
  2 + the answer's leading digit ("s1"), 3 + all of its digits but the last ("s13").
- countdown: 1 the first operation of the worked answer ("f3*7"), 2 + the expression's skeleton
  with the numbers as n ("k(n*n)+n"), 3 the skeleton filled except its last number ("k(3*7)+n").
"""

from __future__ import annotations

import ast
import hashlib
import random
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from embodied_rl.errors import UserError

SPLITS = ("train", "test")
# the longest completion a reward parses; longer text is malformed (and parsing it could be slow)
MAX_COMPLETION_CHARS = 200


@dataclass(frozen=True)
class Problem:
    key: str                 # canonical form: equal keys are the same problem (and share a split)
    prompt: str
    answer: str              # the worked answer (the SFT target, without the end-of-sequence token)
    data: dict[str, Any] = field(default_factory=dict, compare=False)  # what the reward checks


def split_of(key: str, test_percent: int) -> str:
    """The split of a problem key: a hash, so it depends on the problem only."""
    bucket = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % 100
    return "test" if bucket < test_percent else "train"


def answer_text(completion: str) -> str:
    """The answer part of a completion: up to the first newline, stripped."""
    return completion.split("\n", 1)[0].strip()


class LMTask:
    """Base class: `sample(rng)` draws one problem of either split; the rest is shared."""

    name = ""
    hint_tiers = 0  # tiers of in-prompt hints (`hint`); 0: the task has none

    def __init__(self, test_percent: int = 10):
        if not isinstance(test_percent, int) or isinstance(test_percent, bool) or not 1 <= test_percent <= 50:
            raise UserError(f"task.test_percent must be an integer in [1, 50], got {test_percent!r}")
        self.test_percent = test_percent

    def sample(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def score(self, problem: Problem, completion: str) -> float:
        raise NotImplementedError

    def reward(self, problem: Problem, completion: Any) -> float:
        """1.0 for a correct completion, 0.0 for anything else; never raises."""
        try:
            if not isinstance(completion, str) or len(completion) > MAX_COMPLETION_CHARS:
                return 0.0
            return float(self.score(problem, completion))
        except Exception:  # a reward must never stop training: malformed is simply wrong
            return 0.0

    def hint(self, problem: Problem, tier: int) -> str:
        """The hint of `tier` (1..hint_tiers, 1 the most abstract) for `problem`."""
        raise NotImplementedError

    def hinted_prompt(self, problem: Problem, tier: int) -> str:
        """The prompt with the hint of `tier` before it (tier 0: the prompt itself)."""
        if not 0 <= tier <= self.hint_tiers:
            raise ValueError(f"{self.name} has hint tiers 1..{self.hint_tiers}, got {tier}")
        return problem.prompt if tier == 0 else f"{self.hint(problem, tier)} {problem.prompt}"

    def split(self, problem: Problem) -> str:
        return split_of(f"{self.name}:{problem.key}", self.test_percent)

    def stream(self, split: str, seed: int, tag: str = ""):
        """An endless deterministic stream of problems of `split` (repeats possible). Streams with
        different tags are independent: RL's problems (tag "rl") are not the SFT set drawn with the
        same seed, replayed in its order."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rng = random.Random(f"{self.name}/{split}/{seed}" + (f"/{tag}" if tag else ""))
        while True:
            problem = self.sample(rng)
            if self.split(problem) == split:
                yield problem

    def problems(self, split: str, count: int, seed: int = 0) -> list[Problem]:
        """`count` distinct problems of `split`; fewer when the split has fewer (a small task):
        the search stops after 1000 draws in a row bring no new problem."""
        found: dict[str, Problem] = {}
        misses = 0
        for problem in self.stream(split, seed):
            misses = 0 if problem.key not in found else misses + 1
            found.setdefault(problem.key, problem)
            if len(found) >= count or misses >= 1000:
                break
        return list(found.values())


class AdditionTask(LMTask):
    """a + b, each operand uniform over the integers of min_digits..digits digits. Uniform over
    the problems, not over digit counts: drawing the count first would make one-digit sums (100
    of them) a quarter of all training draws at digits=2 while the held-out set, distinct problems,
    is mostly two-digit sums, so training and evaluation would see different tasks.
    `min_carries` / `max_carries` keep the problems with that many columns that carry (drawn
    again otherwise): a difficulty dial at a fixed length (a model that learned single carries
    may fail on chains of them; a tiny model does not generalise to more digits at all)."""

    name = "lm/addition"
    hint_tiers = 3

    def __init__(self, digits: int = 3, min_digits: int = 1, min_carries: int = 0, max_carries: int | None = None,
                 test_percent: int = 10):
        super().__init__(test_percent)
        for key, value in (("digits", digits), ("min_digits", min_digits)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 18:
                raise UserError(f"task.{key} must be an integer in [1, 18], got {value!r}")
        if min_digits > digits:
            raise UserError(f"task.min_digits must be <= task.digits={digits}, got {min_digits}")
        max_carries = digits if max_carries is None else max_carries
        for key, value in (("min_carries", min_carries), ("max_carries", max_carries)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= digits:
                raise UserError(f"task.{key} must be an integer in [0, task.digits={digits}], got {value!r}")
        if min_carries > max_carries:
            raise UserError(f"task.min_carries must be <= task.max_carries={max_carries}, got {min_carries}")
        self.digits, self.min_digits = digits, min_digits
        self.min_carries, self.max_carries = min_carries, max_carries

    def _operand(self, rng: random.Random) -> int:
        return rng.randint(0 if self.min_digits == 1 else 10 ** (self.min_digits - 1), 10**self.digits - 1)

    def sample(self, rng: random.Random) -> Problem:
        while True:
            a, b = self._operand(rng), self._operand(rng)
            if self.min_carries <= _carries(a, b).count("1") <= self.max_carries:
                break
        low, high = sorted((a, b))  # a+b and b+a are one problem, so they share a split
        return Problem(key=f"{low}+{high}", prompt=f"{a}+{b}=", answer=str(a + b), data={"sum": a + b})

    def score(self, problem: Problem, completion: str) -> float:
        text = answer_text(completion)
        if not text or not text.isascii() or not text.isdigit():
            return 0.0
        return float(int(text) == problem.data["sum"])

    def hint(self, problem: Problem, tier: int) -> str:
        a, b = (int(x) for x in problem.prompt[:-1].split("+"))
        answer = problem.answer
        shown = {1: "", 2: answer[:1], 3: answer[:max(1, len(answer) - 1)]}[tier]
        return f"c{_carries(a, b)}" + (f" s{shown}" if shown else "")


def _carries(a: int, b: int) -> str:
    """The carry out of each column of a + b, most significant first: 47+85 -> "11"."""
    carries, carry = [], 0
    for column in range(len(str(max(a, b)))):  # least significant column first
        carry = (a // 10**column % 10 + b // 10**column % 10 + carry) // 10
        carries.append(str(carry))
    return "".join(reversed(carries))


class CountdownTask(LMTask):
    """Reach `target` from 3-4 given numbers with + - * / (each number at most once).

    The generator builds a random expression over the numbers with exact integer intermediate
    results and takes its value as the target, so every problem is solvable; that expression is
    the worked answer."""

    name = "lm/countdown"
    hint_tiers = 3

    def __init__(self, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 20,
                 max_target: int = 100, test_percent: int = 10):
        super().__init__(test_percent)
        for key, value, low, high in (("min_numbers", min_numbers, 2, 6), ("max_numbers", max_numbers, 2, 6),
                                      ("max_number", max_number, 2, 1000), ("max_target", max_target, 1, 100000)):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise UserError(f"task.{key} must be an integer in [{low}, {high}], got {value!r}")
        if min_numbers > max_numbers:
            raise UserError(f"task.min_numbers must be <= task.max_numbers={max_numbers}, got {min_numbers}")
        self.min_numbers, self.max_numbers = min_numbers, max_numbers
        self.max_number, self.max_target = max_number, max_target

    def _expression(self, rng: random.Random, numbers: list[int]) -> tuple[str, int] | None:
        """A random expression using every number in `numbers` once, with its integer value."""
        terms = [(str(n), n) for n in numbers]
        while len(terms) > 1:
            i, j = rng.sample(range(len(terms)), 2)
            (left, a), (right, b) = terms[i], terms[j]
            op = rng.choice("+-*/")
            if op == "-" and a < b:
                (left, a), (right, b) = (right, b), (left, a)
            if op == "/" and (b == 0 or a % b):
                op = "+"
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
            terms = [t for k, t in enumerate(terms) if k not in (i, j)] + [(f"({left}{op}{right})", value)]
        text, value = terms[0]
        if text.startswith("(") and _matching_paren(text) == len(text) - 1:
            text = text[1:-1]
        return text, value

    def sample(self, rng: random.Random) -> Problem:
        while True:
            count = rng.randint(self.min_numbers, self.max_numbers)
            numbers = [rng.randint(1, self.max_number) for _ in range(count)]
            used = rng.randint(2, count)  # the target may need only some of the numbers
            text, target = self._expression(rng, rng.sample(numbers, used))
            if 1 <= target <= self.max_target:
                break
        listed = ",".join(map(str, numbers))
        key = f"{','.join(map(str, sorted(numbers)))}>{target}"
        return Problem(key=key, prompt=f"{target} from {listed}:", answer=text,
                       data={"numbers": numbers, "target": target})

    def score(self, problem: Problem, completion: str) -> float:
        text = answer_text(completion)
        if not text or not set(text) <= set("0123456789+-*/() "):
            return 0.0
        tree = ast.parse(text, mode="eval").body
        used: list[int] = []
        value = _evaluate(tree, used)
        available = list(problem.data["numbers"])
        for number in used:
            if number not in available:
                return 0.0
            available.remove(number)
        return float(value == problem.data["target"])

    def hint(self, problem: Problem, tier: int) -> str:
        tree = ast.parse(problem.answer, mode="eval").body
        first = _first_operation(tree)
        if tier == 1:
            return f"f{first}"
        numbers = [str(n) for n in _literals(tree)]
        skeleton = problem.answer
        for number in numbers:  # left to right: each literal becomes n
            skeleton = skeleton.replace(number, "#", 1)
        if tier == 2:
            return f"f{first} k{skeleton.replace('#', 'n')}"
        filled = skeleton
        for number in numbers[:-1]:
            filled = filled.replace("#", number, 1)
        return f"k{filled.replace('#', 'n')}"


def _first_operation(node: ast.AST) -> str:
    """The text of the first operation evaluated (left to right) whose operands are numbers."""
    if isinstance(node, ast.BinOp):
        for child in (node.left, node.right):
            if isinstance(child, ast.BinOp):
                return _first_operation(child)
        symbol = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}[type(node.op)]
        return f"{node.left.value}{symbol}{node.right.value}"
    return str(node.value)  # a single number


def _literals(node: ast.AST) -> list[int]:
    """The integer literals of an expression, left to right."""
    if isinstance(node, ast.BinOp):
        return _literals(node.left) + _literals(node.right)
    return [node.value]


def _matching_paren(text: str) -> int:
    """The index of the parenthesis that closes text[0]."""
    depth = 0
    for i, char in enumerate(text):
        depth += char == "("
        depth -= char == ")"
        if depth == 0:
            return i
    return -1


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """The exact value of an arithmetic expression tree of integer literals and + - * /;
    appends every literal to `used`. Anything else raises (the reward turns that into 0)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            return left / right  # ZeroDivisionError -> reward 0
    raise ValueError(f"not allowed in an answer: {type(node).__name__}")


TASKS: dict[str, type[LMTask]] = {"lm/addition": AdditionTask, "lm/countdown": CountdownTask}
# keys of a task config that are not constructor arguments
NON_TASK_KEYS = ("name", "pretrain_steps", "max_new_tokens")


def make_task(task_cfg: Any) -> LMTask:
    """The task a `task` config section describes (its keys besides NON_TASK_KEYS are arguments)."""
    from omegaconf import OmegaConf

    options = OmegaConf.to_container(task_cfg, resolve=True) if OmegaConf.is_config(task_cfg) else dict(task_cfg)
    name = options.pop("name")
    if name not in TASKS:
        raise UserError(f"unknown language task '{name}' (choose from: {', '.join(TASKS)})")
    for key in NON_TASK_KEYS:
        options.pop(key, None)
    try:
        return TASKS[name](**options)
    except TypeError as error:
        raise UserError(f"bad task config for {name}: {error}") from None
