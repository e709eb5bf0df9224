"""`python -m mlx_kvq ARGS` is `mlx-kvq ARGS`."""

import sys

from mlx_kvq.commands import main

sys.exit(main())
