"""`python -m llmtrain ...` is the `llmtrain` command; under torchrun: `torchrun -m llmtrain run cfg.yaml`."""

import sys

from llmtrain.core_mesh.cli import main

sys.exit(main())
