"""Where foxlm writes: the one output policy of every command that saves something (convert, finetune, eval, demo,
bench). docs/outputs.md says it for users.

- A target that exists and holds anything is refused unless `force`; `force` replaces only a folder foxlm wrote (it
  holds `MARKER`), and never one that holds a source or the working directory.
- Every save is staged beside its target and renamed into place, so a crash at any moment leaves the previous output
  or the new one, never a mix: `staged_folder` for folders, `write_file_atomic` for single files.
- The next save beside a target removes what a dead foxlm process left staged there, or puts back a previous output
  that such a crash left moved aside (`clean_stale_staging`).
- Outputs get the usual permissions (0777 and 0666 less the umask), not the 0700 and 0600 of `tempfile`.
"""

import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import socket
from pathlib import Path

from .errors import FoxlmError

MARKER = ".foxlm-output"  # in every folder foxlm writes: what --force may replace
# Staged entries are named `.<target>.foxlm-<kind>.<host>.<pid>.<random>`: the host and process tell whether the
# process that staged them is gone (only this host's processes can be checked).
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "localhost"
_UMASK = os.umask(0o022)  # read by setting it (the only way), then set back at once
os.umask(_UMASK)
_STAGED = re.compile(r"^\.(?P<name>.+)\.foxlm-(?P<kind>staging|replaced)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\."
                     r"[0-9a-f]+$")


class OutputError(FoxlmError):
    """foxlm will not write where it was asked to; nothing was changed."""


def is_foxlm_output(folder):
    """Whether foxlm wrote `folder` (it holds foxlm's marker file)."""
    return (Path(folder) / MARKER).is_file()


def holds_files(folder):
    """Whether `folder` exists and holds anything besides foxlm's marker."""
    folder = Path(folder)
    return folder.is_dir() and any(entry.name != MARKER for entry in folder.iterdir())


def check_target(target, *, force=False, sources=()):
    """The folder `target`, resolved, once it may be written: absent or empty, or with `force` a folder foxlm wrote.

    A folder that is (or holds) the working directory or one of the local paths in `sources` is never written over,
    `force` or not. Raises OutputError, whose message says what to do. What dead foxlm processes left staged beside
    `target` is cleaned first (`clean_stale_staging`): the check sees what a crash really left.
    """
    given = Path(target).expanduser()
    target = given.resolve()
    clean_stale_staging(target.parent)
    if target.exists() and not target.is_dir():
        raise OutputError(f"{given} exists and is not a folder; choose another output folder.")
    if target.exists():
        inside = [("the working directory", Path.cwd())]
        inside += [(f"the source {source}", Path(source).expanduser()) for source in sources]
        for what, path in inside:
            path = path.resolve()
            if path.exists() and (path == target or target in path.parents):
                raise OutputError(f"{given} holds {what}, which foxlm never writes over; choose another output "
                                  "folder.")
    if not holds_files(target):
        return target
    if not force:
        raise OutputError(f"{given} exists and is not empty; pass --force (force=True) to replace it, or choose "
                          "another output folder.")
    if not is_foxlm_output(target):
        raise OutputError(f"{given} was not written by foxlm (it has no {MARKER} file), and --force replaces only "
                          "folders foxlm wrote; remove it yourself or choose another output folder.")
    return target


def stamp():
    """What foxlm writes into its folders' markers and its result files, to know them again: "foxlm <version>"."""
    from . import __version__

    return f"foxlm {__version__}"


def write_marker(folder, **facts):
    """Mark `folder` as written by foxlm (`facts`: what it holds; no paths, since folders get published)."""
    write_file_atomic(Path(folder) / MARKER, json.dumps({"written_by": stamp(), **facts}, indent=1) + "\n")


def check_result_files(folder, names, *, force=False):
    """The paths of the result files `names` (JSON, PNG) in `folder`, once they may be written: absent, or with
    `force` files foxlm wrote (their stamp says so; `write_file_atomic` replaces each whole). Nothing else in the
    folder is touched."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{folder} is a file; choose a folder for the results.")
    paths = [folder / name for name in names]
    existing = [str(path) for path in paths if path.exists()]
    if existing and not force:
        raise OutputError(f"{', '.join(existing)} exists; pass --force to replace it, or choose another "
                          "--output-dir.")
    theirs = [path for path in existing if not result_written_by_foxlm(path)]
    if theirs:
        raise OutputError(f"{', '.join(theirs)} was not written by foxlm, and --force replaces only results foxlm "
                          "wrote; move it away or choose another --output-dir.")
    return paths


def result_written_by_foxlm(path):
    """Whether foxlm wrote the result file `path`: a JSON object whose `written_by` is foxlm's stamp, or a PNG whose
    Software text is."""
    path = Path(path)
    try:
        if path.suffix == ".json":
            written_by = json.loads(path.read_text()).get("written_by", "")
        elif path.suffix == ".png":
            from PIL import Image  # matplotlib's own dependency

            with Image.open(path) as image:
                written_by = image.info.get("Software", "")
        else:
            return False
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON or not a JSON object, not a PNG
        return False
    return str(written_by).startswith("foxlm ")


def make_output_folder(folder, **facts):
    """Create `folder` (with its parents) and mark it as foxlm's, as an empty one that exists; a folder that holds
    anything is left as it is (foxlm did not write it)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not holds_files(folder) and not is_foxlm_output(folder):
        write_marker(folder, **facts)
    return folder


@contextlib.contextmanager
def staged_folder(target, *, force=False, sources=(), **facts):
    """Yield an empty folder beside `target`; when the block ends without an error it becomes `target`, marked as
    foxlm's (`facts` go into the marker) and replacing what `check_target` allows, in one rename. On an error, or a
    target that became unwritable in the meantime, it is removed and `target` is left as it was."""
    target = check_target(target, force=force, sources=sources)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _staged_path(target, "staging")
    staging.mkdir()
    try:
        yield staging
        write_marker(staging, **facts)
        _sync_tree(staging)
        check_target(target, force=force, sources=sources)  # what is there now, not when the work began
        _move_into_place(staging, target)
    finally:
        # After an error the half-written output; after a swap the previous one.
        shutil.rmtree(staging, ignore_errors=True)


def write_file_atomic(path, data):
    """Write `data` (str or bytes) to `path` through a staged file renamed into place: readers see the old file or
    the whole new one, never part of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(path.parent)
    staging = _staged_path(path, "staging")
    try:
        with open(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    _fsync(path.parent)
    return path


def clean_stale_staging(folder):
    """Remove what dead foxlm processes of this host left staged in `folder`. A previous output that a crash left
    moved aside (the two-rename fallback of `_move_into_place`) goes back in place when its target is missing."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        match = _STAGED.match(entry.name)
        if match is None or match["host"] != _HOST or _process_alive(int(match["pid"])):
            continue
        target = folder / match["name"]
        if match["kind"] == "replaced" and not target.exists():
            os.rename(entry, target)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _staged_path(target, kind):
    return target.with_name(f".{target.name}.foxlm-{kind}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}")


def _process_alive(pid):
    if os.name == "nt":  # os.kill there terminates the process: never judge another process dead
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _move_into_place(staging, target):
    """Rename `staging` to `target`. A `target` that exists is swapped with it in one step where the system can (then
    `staging` holds the previous output); elsewhere two renames, whose gap `clean_stale_staging` repairs."""
    if not target.exists():
        os.rename(staging, target)
    elif not _exchange(staging, target):
        aside = _staged_path(target, "replaced")
        os.rename(target, aside)
        os.rename(staging, target)
        shutil.rmtree(aside, ignore_errors=True)
    _fsync(target.parent)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
try:
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # Linux, glibc >= 2.28
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
except (AttributeError, OSError):
    _renameat2 = None


def _exchange(a, b):
    """Swap the paths `a` and `b` atomically; False where the system or the file system cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _sync_tree(folder):
    """Give every file of `folder` the usual permissions (safetensors writes 0600: unreadable to the group that shares
    a model), and flush it to the disk before the folder is renamed into place: after a power cut, too, the renamed
    folder is then complete."""
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                os.chmod(path, 0o666 & ~_UMASK)
            _fsync(path)
        _fsync(root)


def _fsync(path):
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:  # a folder where the system cannot open one (Windows)
        return
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # folders some file systems cannot flush
            raise
    finally:
        os.close(descriptor)


# --- `foxlm finetune`: its run folder and the models it saves there ---------------------------------------------


def prepare_run_folder(run_dir, *, force=False, resume=False, eval_only=False, sources=()):
    """Apply the output policy to `foxlm finetune`'s run folder before any work: a new run needs an empty or absent
    folder; `resume` continues and `eval_only` evaluates the run there; `force` starts over, replacing a run foxlm
    wrote. Returns the folder."""
    run_dir = Path(run_dir)
    if force and (resume or eval_only):
        raise OutputError(f"--force starts a new run, --{'resume' if resume else 'eval-only'} uses the one in "
                          f"{run_dir}: give one of them.")
    clean_stale_staging(run_dir.expanduser().resolve().parent)
    clean_stale_staging(run_dir)  # its saves: adapter/, fine-tuned/, train_log.json, ...
    checkpoints = run_dir / "checkpoints"
    if resume and last_complete_checkpoint(checkpoints) is None:
        raise OutputError(f"--resume: no complete checkpoint in {checkpoints}; run without --resume to start a new "
                          "run.")
    if resume or eval_only:  # what --eval-only needs is checked by the job
        return run_dir
    if holds_files(run_dir):
        if not force:
            held = ", ".join(sorted(entry.name for entry in run_dir.iterdir() if entry.name != MARKER))
            raise OutputError(f"{run_dir} holds an earlier run ({held}); pass --resume to continue its training, "
                              "--eval-only to evaluate it, --force to start over in its place, or choose another "
                              "--output-dir.")
        # The earlier run goes in one rename, and its copy only once the new folder exists: a crash in between gives
        # it back (`clean_stale_staging`), a crash while deleting leaves no half-deleted run where it was.
        earlier = check_target(run_dir, force=True, sources=sources)
        aside = _staged_path(earlier, "replaced")
        os.rename(earlier, aside)
        make_output_folder(earlier, holds="foxlm finetune run")
        shutil.rmtree(aside, ignore_errors=True)
        print(f"--force: removed the earlier run in {run_dir}; starting a new one")
    return make_output_folder(run_dir, holds="foxlm finetune run")


def last_complete_checkpoint(folder):
    """The newest Trainer checkpoint in `folder` that was saved to the end (Trainer writes trainer_state.json last),
    or None. Newer ones a crash cut short are removed, so that the resumed run saves over nothing half-written."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    steps = [(int(match[1]), path) for path in folder.iterdir()
             if (match := re.fullmatch(r"checkpoint-(\d+)", path.name)) and path.is_dir()]
    for _, path in sorted(steps, reverse=True):
        if (path / "trainer_state.json").is_file():
            return str(path)
        shutil.rmtree(path)
    return None


def save_model_folder(target, model, tokenizer=None, *, card, force=False, sources=(), **save_kwargs):
    """Save `model` (and `tokenizer`) with the model card `card` as README.md into `target`, staged and renamed into
    place (`staged_folder`); `save_kwargs` go to `save_pretrained`."""
    with staged_folder(target, force=force, sources=sources, holds="model") as staging:
        model.save_pretrained(staging, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        # After the model: PEFT writes a README.md of its own, with local paths in it.
        (staging / "README.md").write_text(card)
    return Path(target)


def save_fine_tuning(run_dir, trainable, tokenizer, trainer, args):
    """The end of `foxlm finetune`'s training: adapter/ (LoRA) and fine-tuned/ (the merged or fully trained model),
    each a complete model folder with its card, staged and renamed into place, then train_log.json."""
    from .model_card import adapter_card, fine_tuned_card, fine_tuning_facts

    run_dir = Path(run_dir)
    facts = fine_tuning_facts(run_dir / "converted", trainer, args)
    model = trainable
    if not args.full:
        save_model_folder(run_dir / "adapter", trainable, tokenizer, card=adapter_card(facts), force=True)
        model = trainable.merge_and_unload()
    # A complete model folder (tokenizer included): `foxlm eval` and generate() use it.
    save_model_folder(run_dir / "fine-tuned", model, tokenizer, card=fine_tuned_card(facts), force=True)
    write_file_atomic(run_dir / "train_log.json", json.dumps(trainer.state.log_history, indent=2) + "\n")
