"""`python -m node_agent.cli`: the same as the `lorafleet-agent` console script."""

import sys

from node_agent.cli.main import main

sys.exit(main())
