"""The whole suite: commands that pick a pair by default run on the toy pair (fast), so a
test names `--pair smollm2` (or uses tests/realpair) when it means the real one."""

import os

os.environ["MUSER_PAIR"] = "toy"
