"""Language tasks: rewards (hostile completions included), disjoint splits, determinism."""

import random

import pytest

from embodied_rl.errors import UserError
from embodied_rl.lm.tasks import AdditionTask, CountdownTask, Problem, make_task, split_of


def countdown_problem(numbers, target):
    return Problem(key="k", prompt="p", answer="", data={"numbers": numbers, "target": target})


HOSTILE = [None, 3, b"12", "", " ", "\n", "x" * 10_000, "(" * 300 + "1" + ")" * 300, "1" * 199, "__import__('os')",
           "1e3", "1_000", "0x10", "\x00", "٣", "¹", "1+", "+1", "-1", "1 2", "9" * 5000, "((1)", "1/0", "2**99999",
           "lambda: 1", "[1]", "1;2", "1\n2", "∞", "NaN"]


def test_addition_reward():
    task = AdditionTask(digits=3)
    problem = Problem(key="12+30", prompt="12+30=", answer="42", data={"sum": 42})
    assert task.reward(problem, "42") == 1.0
    assert task.reward(problem, " 42 \nrest is ignored") == 1.0
    assert task.reward(problem, "042") == 1.0  # the number is right
    for wrong in ("43", "4 2", "42.0", "+42", "forty-two", "٤٢"):
        assert task.reward(problem, wrong) == 0.0, wrong
    for completion in HOSTILE:
        assert task.reward(problem, completion) == 0.0, completion


def test_countdown_reward():
    task = CountdownTask()
    problem = countdown_problem([3, 7, 25, 2], 154)
    assert task.reward(problem, "(25-3)*7") == 1.0
    assert task.reward(problem, "7*(25-3)") == 1.0
    assert task.reward(problem, "(25 - 3) * 7\n") == 1.0
    assert task.reward(problem, "(25-3)*7*1") == 0.0   # 1 is not given
    assert task.reward(problem, "(25-3)*7+2-2") == 0.0  # 2 given once, used twice
    assert task.reward(problem, "(25-3)*8") == 0.0      # 8 not given
    assert task.reward(problem, "25*7") == 0.0          # wrong value
    assert task.reward(countdown_problem([3, 3, 4], 6), "3+3") == 1.0  # repeated numbers, each once
    assert task.reward(countdown_problem([7, 2], 3), "7/2") == 0.0     # exact arithmetic: 3.5
    assert task.reward(countdown_problem([7, 2, 2], 7), "7/(2-2)") == 0.0
    assert task.reward(countdown_problem([6, 4, 3], 8), "6/3*4") == 1.0
    for completion in HOSTILE:
        assert task.reward(problem, completion) == 0.0, completion


@pytest.mark.parametrize("task", [AdditionTask(digits=3), CountdownTask()])
def test_worked_answers_earn_the_reward(task):
    for problem in task.problems("train", 200, seed=1) + task.problems("test", 50, seed=1):
        assert task.reward(problem, problem.answer) == 1.0, problem


@pytest.mark.parametrize("task", [AdditionTask(digits=2), CountdownTask(max_numbers=3)])
def test_splits_are_disjoint_and_deterministic(task):
    train = task.problems("train", 2000, seed=0)
    test = task.problems("test", 300, seed=0)
    assert not {p.key for p in train} & {p.key for p in test}
    other_seed = task.problems("train", 2000, seed=5)
    assert not {p.key for p in other_seed} & {p.key for p in test}  # the split ignores the seed
    assert task.problems("test", 300, seed=0) == test  # same seed, same problems
    assert [p.prompt for p in task.problems("train", 50, seed=1)] != [p.prompt for p in train[:50]]
    assert 0.03 < len(test) / 300 <= 1 and all(task.split(p) == "test" for p in test)


def test_addition_commutes_within_a_split():
    task = AdditionTask(digits=2)
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        assert split_of(f"{task.name}:{min(a, b)}+{max(a, b)}", 10) == task.split(
            Problem(key=f"{min(a, b)}+{max(a, b)}", prompt=f"{b}+{a}=", answer=""))


def test_small_test_split_terminates():
    problems = AdditionTask(digits=1).problems("test", 1000)  # 55 problems in all
    assert 0 < len(problems) < 55


def test_make_task_refuses_bad_options():
    assert isinstance(make_task({"name": "lm/addition", "digits": 2, "pretrain_steps": 5}), AdditionTask)
    with pytest.raises(UserError, match="task.digits"):
        make_task({"name": "lm/addition", "digits": 0})
    with pytest.raises(UserError, match="min_digits"):
        make_task({"name": "lm/addition", "digits": 2, "min_digits": 3})
    with pytest.raises(UserError, match="unknown language task"):
        make_task({"name": "lm/nope"})
    with pytest.raises(UserError, match="bad task config"):
        make_task({"name": "lm/countdown", "colour": 1})


def test_addition_trains_on_the_problem_mix_it_is_evaluated_on():
    """Training draws and the held-out set (distinct problems) hold two-digit sums in the same share."""
    import itertools

    task = AdditionTask(digits=2)
    def two_digit_share(problems):
        return sum(all(len(x) == 2 for x in p.prompt.rstrip("=").split("+")) for p in problems) / len(problems)
    draws = list(itertools.islice(task.stream("train", 0), 4000))
    assert abs(two_digit_share(draws) - two_digit_share(task.problems("test", 500))) < 0.05
    assert two_digit_share(draws) == pytest.approx(0.81, abs=0.03)  # 90 of 100 operands have two digits


def test_rl_does_not_start_on_the_sft_set_of_its_seed():
    """`pretrain lm.sft_problems=500 seed=S` memorises the first 500 problems of the seed's stream;
    RL with the same seed draws its own stream, so it meets those problems only by chance (~6%)."""
    import itertools

    from embodied_rl.lm.rl import rl_problem_stream

    task = AdditionTask(digits=2)
    sft_set = {p.key for p in task.problems("train", 500, seed=1)}
    rl_first = [p.key for p in itertools.islice(rl_problem_stream(task, 1), 500)]
    assert sum(key in sft_set for key in rl_first) < 0.15 * len(rl_first)
    assert rl_first == [p.key for p in itertools.islice(rl_problem_stream(task, 1), 500)]  # deterministic
