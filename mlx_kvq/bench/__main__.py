"""`python -m mlx_kvq.bench ARGS` is `mlx-kvq bench ARGS`."""

import sys

from mlx_kvq.commands import main

sys.exit(main(["bench", *sys.argv[1:]]))
