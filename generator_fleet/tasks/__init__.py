"""Prompt sources and reward functions, looked up by the names used in the job spec."""

from generator_fleet.tasks.arith import ArithTask

TASKS = {"arith": ArithTask}

__all__ = ["ArithTask", "TASKS"]
