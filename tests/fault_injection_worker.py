"""Run a `foxlm` command and SIGKILL it at one moment of its saves (tests/test_fault_injection.py):

    python tests/fault_injection_worker.py MOMENT:WHERE foxlm-arguments...

WHERE is a substring of the path being saved; MOMENT is one of
    half-written  halfway through writing a weights file (safetensors, or torch.save: optimizer state) under WHERE
    staged        a staged folder for WHERE is complete, just before it is renamed into place
    swapped       just after the staged folder replaced WHERE (the previous output is still in the staging name)
    gap           with no atomic exchange (the two-rename fallback), between moving the previous WHERE aside and
                  renaming the new one into place
    file          a staged single file WHERE (JSON, PNG) is written, just before it is renamed into place
The process exits 3 if it ends without reaching MOMENT.
"""

import os
import signal
import sys
from pathlib import Path


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def install(moment, where):
    import safetensors.torch
    import torch

    import foxlm.cli  # noqa: F401 - the modules whose saves are patched, imported as the command would
    import foxlm.finetune  # noqa: F401
    from foxlm import outputs

    if moment == "half-written":
        def half_written(write):
            def write_then_die(obj, path, *args, **kwargs):
                result = write(obj, path, *args, **kwargs)
                if where in str(path):
                    size = Path(path).stat().st_size
                    os.truncate(path, size // 2)
                    die()
                return result
            return write_then_die

        original = safetensors.torch.save_file
        for module in list(sys.modules.values()):  # every module that imported save_file, under any name
            for name, value in list(getattr(module, "__dict__", {}).items()):
                if value is original:
                    setattr(module, name, half_written(original))
        torch.save = half_written(torch.save)
    elif moment in ("staged", "swapped"):
        move = outputs._move_into_place

        def move_and_die(staging, target):
            if where in str(target) and moment == "staged":
                die()
            move(staging, target)
            if where in str(target):
                die()

        outputs._move_into_place = move_and_die
    elif moment == "gap":
        rename = os.rename
        outputs._exchange = lambda a, b: False

        def rename_and_die(src, dst, *args, **kwargs):
            rename(src, dst, *args, **kwargs)
            if ".foxlm-replaced." in str(dst) and where in str(dst):
                die()

        os.rename = rename_and_die
    elif moment == "file":
        replace = os.replace

        def replace_or_die(src, dst, *args, **kwargs):
            if ".foxlm-staging." in str(src) and str(dst).endswith(where):
                die()
            return replace(src, dst, *args, **kwargs)

        os.replace = replace_or_die
    else:
        raise SystemExit(f"unknown moment {moment!r}")


if __name__ == "__main__":
    spec, *arguments = sys.argv[1:]
    moment, _, where = spec.partition(":")
    install(moment, where)
    from foxlm.cli import main

    main(arguments)
    sys.exit(3)
