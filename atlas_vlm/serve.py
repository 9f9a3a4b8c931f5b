"""``python -m atlas_vlm.serve [MODEL] [flags]``: same as ``atlas-vlm serve`` (see ``atlas_vlm.entrypoints.cli``)."""

import sys

from atlas_vlm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
