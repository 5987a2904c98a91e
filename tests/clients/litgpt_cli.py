"""`litgpt` on fabric: litgpt's own command line, with `lightning.fabric` imports aliased to fabric.

    python tests/clients/litgpt_cli.py pretrain --config ...      # what `litgpt pretrain --config ...` does

Nothing of litgpt is edited or patched: the alias is installed, then litgpt's CLI entry point runs. Processes that
`fabric.launch()` starts re-run this file, so they get the alias too.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning_alias

lightning_alias.install()

from litgpt.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
