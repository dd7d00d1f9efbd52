"""What a command writes and reads besides its ranks: an output written whole or not at all (write_atomically,
write_json, save_figure), checked writable and not an input before any rank starts (check_writable), and a
checkpoint to resume from checked against its own metadata (read_checkpoint, check_checkpoint_model)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist


def one_line(error):
    """An exception as one line, 'Type: message', whatever newlines its message holds."""
    return " ".join(f"{type(error).__name__}: {error}".split())


class WriteError(OSError):
    """An output that could not be written (a full disk, a folder gone): one line, exit 1 (exit_code)."""


def umask():
    """This process's umask (the permissions a new file does not get)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path, write):
    """Write the file `path` whole or not at all: write(f) fills a temporary file beside it (binary), which then
    replaces it in one rename, so that no reader (the launcher, a user) ever sees half a file and a failed write
    leaves what `path` held before as it was. A link is followed (its target replaced); a path that is not a
    regular file (/dev/stdout, a pipe) is written straight. WriteError (one line) if it cannot be written."""
    straight = os.path.exists(path) and not os.path.isfile(path)  # /dev/stdout: a link to a pipe, written through
    real, partial = path if straight else os.path.realpath(path), None
    try:
        if straight:
            with open(real, "wb") as f:
                write(f)
            return
        fd, partial = tempfile.mkstemp(prefix=f".{os.path.basename(real)}.", suffix=".partial",
                                       dir=os.path.dirname(real))
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(partial, os.stat(real).st_mode & 0o7777 if os.path.exists(real) else 0o666 & ~umask())
        os.replace(partial, real)
    except OSError as e:
        kept = "; the file there before is unchanged" if not straight and os.path.exists(real) else ""
        raise WriteError(f"{path} could not be written: {e.strerror or e}{kept}") from None
    finally:
        if partial is not None and os.path.exists(partial):
            os.remove(partial)


def write_folder_atomically(path, write, group=None):
    """The folder `path` written whole or not at all by every rank of `group` (None: the world) at once, as
    torch.distributed.checkpoint saves: write(folder) fills `path`.partial beside it, then rank 0 puts it in place
    of `path` (two renames; the folder there before is removed only then). A save that fails or never ends leaves
    the folder there before as it was; its `path`.partial, without the .metadata its last step writes, is removed
    by the next save."""
    partial = os.path.normpath(path) + ".partial"
    first = dist.get_rank(group) == 0
    if first:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier(group)
    write(partial)
    dist.barrier(group)  # every rank's files written
    if first:
        old = os.path.normpath(path) + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group)  # in place before any rank goes on (and may read it)


def save_figure(fig, path, **savefig):
    """A matplotlib figure into `path` (its format the path's extension, PNG without one), atomically."""
    kind = os.path.splitext(path)[1][1:].lower() or "png"
    write_atomically(path, lambda f: fig.savefig(f, format=kind, **savefig))


def is_code_file(path):
    """Whether `path` is a file of the code this process runs: its script, or a module it has imported (only the
    files of the same name are resolved: thousands of modules are loaded with torch)."""
    real = os.path.realpath(path)
    files = [sys.argv[0] if sys.argv else ""] + [getattr(m, "__file__", None) for m in list(sys.modules.values())]
    return any(isinstance(f, str) and os.path.basename(f) == os.path.basename(real) and os.path.realpath(f) == real
               for f in files)


def check_not_input(path, option, inputs=None):
    """Nothing a command writes may be one of its inputs: a ValueError (one line) if `path`, which the command
    will write (a file, or a folder it writes into), is one of `inputs` ({what it is: its path}, the files or
    folders it reads), or a file of the code it runs (its script, a module it imported: --json muon_tools/cli.py)."""
    real = os.path.realpath(path)
    for what, given in (inputs or {}).items():
        if given and os.path.realpath(given) == real:
            raise ValueError(f"{option} {path} is {what}, which this command reads: it would write over its own "
                             f"input")
    if is_code_file(real):
        raise ValueError(f"{option} {path} is a file of the code this command runs: it would write over it")


def check_outputs(outputs):
    """Each output of a command names its own file: {option: path} (None or "": not given), a ValueError
    (one line) for two that are the same file (the second written over the first)."""
    seen = {}
    for option, path in outputs.items():
        if path:
            real = os.path.realpath(path)
            if real in seen:
                raise ValueError(f"{option} {path} is also {seen[real]}: one output would be written over the other")
            seen[real] = f"{option} {path}"


def check_writable(path, option="--json", folder=False, inputs=None):
    """Raise ValueError (one line) unless `path`, a file the run will write (or with folder=True, a folder it
    will write into, made with any missing parents), can be written: checked before any rank starts by
    creating it, since only that tells (as root, os.access says yes even to /proc). What this creates it
    removes at once, so that nothing is left however the run ends (whoever writes it creates it again); a
    file already there is opened for appending, not changed. Every rank of a torchrun job may check the
    same path: each removes only what it created (O_EXCL). Nor may it be an input (check_not_input: `inputs`,
    and the code this process runs)."""
    check_not_input(path, option, inputs)
    parent = os.path.dirname(os.path.abspath(path))
    if not folder and os.path.isdir(path):
        raise ValueError(f"{option} {path} is a directory")
    if folder and os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"{option} {path} is not a folder")
    if not folder and not os.path.isdir(parent):
        raise ValueError(f"{option} {path}: the folder {parent} does not exist")
    made = []  # the folders this makes, deepest first
    try:
        if folder:
            missing = os.path.abspath(path)
            while not os.path.lexists(missing):
                made.append(missing)
                missing = os.path.dirname(missing)
            os.makedirs(path, exist_ok=True)
            path_in = os.path.join(path, f".probe-{os.getpid()}")
            os.close(os.open(path_in, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            os.remove(path_in)
        else:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
                os.remove(path)
            except FileExistsError:
                with contextlib.suppress(FileNotFoundError):  # a peer's probe, removed since: it could be made
                    os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
    except OSError as e:
        raise ValueError(f"{option} {path} cannot be written: {e.strerror}") from None
    finally:
        for folder_made in made:
            with contextlib.suppress(OSError):
                os.rmdir(folder_made)


def read_checkpoint(path, step, option="--resume"):
    """The state_dict_metadata of the torch.distributed.checkpoint folder `path` a run resumes from after step
    `step`, checked before any rank starts (ValueError, one line): its .metadata there and readable; every file it
    names there, each long enough for what it holds there (a copy or a save that did not finish); and the step its
    optimizer saved (AdamW's `step` counters, a few scalars read from the files) equal to `step`."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(f"{option} {path}: no torch.distributed.checkpoint there (no .metadata)")
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 (whatever the reader raises on a file that is not DCP's metadata)
        raise ValueError(f"{option} {path}: its .metadata cannot be read ({one_line(e)})") from None
    needed = {}  # file: the bytes it must hold at least
    for item in metadata.storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        held = os.path.getsize(file) if os.path.isfile(file) else None
        if held is None or held < size:
            raise ValueError(f"{option} {path}: its file {name} " + ("is missing" if held is None else
                             f"holds {held:,} bytes, its .metadata says {size:,} at least") +
                             ": a copy or a save that did not finish")
    counters = {k: torch.zeros(()) for k, m in metadata.state_dict_metadata.items()
                if k.startswith("optim.state.") and k.endswith(".step") and tuple(getattr(m, "size", (1,))) == ()}
    if counters:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
                dcp.load(counters, checkpoint_id=path, no_dist=True)
        except Exception as e:  # noqa: BLE001 (whatever DCP raises on a file it cannot read)
            raise ValueError(f"{option} {path}: its files cannot be read ({one_line(e)})") from None
        saved = sorted({int(t.item()) for t in counters.values()})
        if saved != [step]:
            raise ValueError(f"{option}-step {step}: {path} was saved after step {saved[0]} (its optimizer's step "
                             f"counters): resume with {option}-step {saved[0]}" if len(saved) == 1 else
                             f"{option} {path}: its optimizer's step counters disagree "
                             f"({', '.join(map(str, saved))}): not one training's checkpoint")
    return metadata.state_dict_metadata


def check_checkpoint_model(path, saved, shapes, hint="", option="--resume"):
    """The model a checkpoint holds (`saved`: read_checkpoint's) against this run's, {parameter name: shape}:
    none missing or extra, each of its size (ValueError, one line). hint: the flags that change the model."""
    where = f"{option} {path}: its checkpoint"
    held = {k.removeprefix("model."): tuple(m.size) for k, m in saved.items() if k.startswith("model.")}
    for name, shape in shapes.items():
        if name not in held:
            raise ValueError(f"{where} has no {name}: it was saved from another model{f' ({hint}?)' if hint else ''}")
        if held[name] != shape:
            raise ValueError(f"{where}'s {name} is {held[name]}, this run's {shape}: resume with the sizes it was "
                             f"saved with")
    extra = sorted(set(held) - set(shapes))
    if extra:
        raise ValueError(f"{where} holds {extra[0]}, which this run's model has not: it was saved from another model"
                         f"{f' ({hint}?)' if hint else ''}")


def write_json(path, results):
    """`results` as JSON into `path` (if given), atomically (write_atomically)."""
    if path:
        write_atomically(path, lambda f: f.write(json.dumps(results, indent=1).encode()))
