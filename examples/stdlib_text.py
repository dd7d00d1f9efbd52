"""Real text with no download: the Python standard library's own source files, as bytes.

Every Python install carries its standard library's sources (megabytes of .py files
once the test suites are left out; the folder comes from
sysconfig.get_paths()["stdlib"], in Colab too). Tokens are the bytes themselves
(vocabulary 256), so there is no tokenizer to fit or download.

    files:       sorted .py paths under the stdlib folder, without site-packages,
                 __pycache__ and the test folders (test, tests, idle_test)
    split:       by file, fixed by the path: crc32(path) % 10 == 0 -> validation
                 (about 1 file in 10), the rest -> training; no file is in both
    a batch:     step s draws `batch` random windows of context + 1 bytes from the
                 training stream with a generator seeded by (seed, s), so every rank
                 draws the same global batch and DP rank r takes rows
                 [r * batch / DP, (r + 1) * batch / DP): the DP ranks together see
                 exactly the batch one process would
    validation:  fixed windows spread evenly over the validation stream

The sources differ between Python versions, so losses are comparable between runs
on the same Python only.
"""

import functools
import os
import sysconfig
import zlib
from dataclasses import dataclass

import torch

SKIPPED_DIRS = {"site-packages", "__pycache__", "test", "tests", "idle_test"}
VALIDATION_ONE_IN = 10


def stdlib_root():
    return sysconfig.get_paths()["stdlib"]


def source_files(root):
    """Sorted paths (relative, with '/') of the standard library's .py files."""
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        rel = os.path.relpath(folder, root)
        paths += [f if rel == "." else "/".join(rel.split(os.sep) + [f]) for f in sorted(files) if f.endswith(".py")]
    return sorted(paths)


def is_validation(path):
    return zlib.crc32(path.encode()) % VALIDATION_ONE_IN == 0


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8, the training files one after another
    val: torch.Tensor  # uint8, the validation files
    n_train_files: int
    n_val_files: int

    def batch(self, step, batch, context, seed, dp_rank=0, dp=1):
        """(inputs, targets), int64 (batch / dp, context): DP rank dp_rank's rows of step's global batch."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.train.numel() - context - 1, (batch,), generator=g)
        rows = batch // dp
        return windows(self.train, starts[dp_rank * rows:(dp_rank + 1) * rows], context)

    def validation(self, n, context, dp_rank=0, dp=1):
        """DP rank dp_rank's share of n fixed validation windows, spread evenly over the stream."""
        starts = torch.linspace(0, self.val.numel() - context - 2, n).long()
        rows = n // dp
        return windows(self.val, starts[dp_rank * rows:(dp_rank + 1) * rows], context)


def windows(stream, starts, context):
    block = torch.stack([stream[s:s + context + 1] for s in starts.tolist()]).long()
    return block[:, :-1], block[:, 1:]


@functools.lru_cache(maxsize=2)
def load_corpus(root=None):
    """The corpus, read once per process."""
    root = root or stdlib_root()
    paths = source_files(root)
    if not paths:
        raise ValueError(f"no .py files under {root}: is this Python's standard library?")
    parts = {True: [], False: []}
    for path in paths:
        with open(os.path.join(root, *path.split("/")), "rb") as fh:
            parts[is_validation(path)].append(fh.read())
    train, val = (torch.frombuffer(bytearray(b"".join(parts[v])), dtype=torch.uint8) for v in (False, True))
    return Corpus(train, val, len(parts[False]), len(parts[True]))
