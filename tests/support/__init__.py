"""Helpers shared by the test files (the test files never import one another).

pyproject.toml's ``[tool.pytest.ini_options] pythonpath = ["tests"]`` puts this package on the path:
``from support.models import mlp``. A test's child process gets the same path from ``paths.child_env``.

* ``paths``: the checkout's folders (tests/data, logs/) and the environment for a child Python process.
* ``models``: small models whose activations dominate their memory (MLP, CNN, GPT, loop LSTM, TreeLSTM).
* ``training``: seeded training steps, the bytes that exist before a step, budgets, gradient checks.
* ``hf``: Hugging Face ``Trainer.train()`` on a tiny GPT-2 from a local config, with a block per step or not.
* ``random_programs``: seeded random PyTorch programs, and bit-for-bit comparison of their results.
* ``reference_core``: a pure-Python reference of the C++ core, for the differential test.
* ``core_ops``: random op sizes and costs for driving the core, and an op's outcome.
* ``planner_graphs``: small graph logs for the planners, brute force, and the schedule check.
"""
