"""A saver SIGKILLed after creating a step's commit file and before writing it leaves that step
uncommitted, never an empty COMMITTED that the next resume stops at: on a local disk the files
of a step appear whole or not at all."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from llmtrain.checkpoint.manager import Checkpointer
from llmtrain.checkpoint.state import Values

# saves step 1, then dies the moment step 2's commit file exists, before a byte is in it
SAVER = textwrap.dedent(
    """
    import os, signal, sys
    import fsspec
    from fsspec.implementations.local import LocalFileSystem
    from llmtrain.checkpoint.manager import Checkpointer
    from llmtrain.checkpoint.state import Values

    class DiesAtCommit(LocalFileSystem):
        protocol = ("dies",)

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(path.removeprefix("dies://"))

        def _open(self, path, mode="rb", **kwargs):
            opened = super()._open(path, mode, **kwargs)
            if "w" in mode and "step-2/COMMITTED" in str(path):
                os.kill(os.getpid(), signal.SIGKILL)
            return opened

    fsspec.register_implementation("dies", DiesAtCommit, clobber=True)
    checkpoints = Checkpointer("dies://" + sys.argv[1])
    checkpoints.save(1, {"counters": Values(step=1, tokens=10)})
    checkpoints.save(2, {"counters": Values(step=2, tokens=20)})
    """
)


def test_a_saver_killed_at_its_commit_leaves_the_step_uncommitted(tmp_path):
    where = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", SAVER, str(where)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (where / "step-2").is_dir()  # it was killed inside step 2's save
    checkpoints = Checkpointer(str(where))
    assert checkpoints.committed_steps() == [1]
    counters = Values(step=0, tokens=0)
    assert checkpoints.load({"counters": counters}) == 1
    assert counters.values == {"step": 1, "tokens": 10}
