"""A reward that freezes process 1 (SIGSTOP, as a node that stops answering) the first time it is called.

Its pid goes to ``pid_file`` first, so that the test can kill it whatever happens.
"""

import os
import signal


def freeze_rank_one(prompts, completions, pid_file: str = "", **kwargs):
    if os.environ.get("RANK") == "1":
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    return [float(len(c) % 3) for c in completions]
