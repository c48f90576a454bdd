# A stop signal is noted from the first moment (orchestrator._util.stopsignals): a worker
# signalled while it starts stops cleanly instead of dying of it.
from orchestrator._util import stopsignals

stopsignals.hold()

from orchestrator.cli import main  # noqa: E402

main()
