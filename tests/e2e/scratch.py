"""A test's scratch directory: removed when the test's process exits, pass
or fail, so that repeated ctest runs do not fill /tmp (one full run leaves
181 MB there without it). DMI_KEEP_TEST_FILES=1 keeps it and prints where."""
import atexit
import os
import shutil
import sys
import tempfile


def scratch_dir(prefix):
    d = tempfile.mkdtemp(prefix=prefix)

    def remove():
        if os.environ.get("DMI_KEEP_TEST_FILES"):
            print(f"kept {d}", file=sys.stderr)
        else:
            shutil.rmtree(d, ignore_errors=True)

    atexit.register(remove)
    return d
