"""``python3 -m cpuos_agent``. In root mode the command spawner is forked first, before
the rest of the agent is imported: under gVisor a fork shares little for long (a write to
a shared page copies the 2 MiB around it), so a spawner forked from the whole agent
would cost about as much memory as the agent itself; forked here it holds only what it
loaded (``spawner``, ``privs`` and their stdlib modules)."""

from . import privs
from .spawner import Spawner

privs.shield_signals()
spawner = None
if privs.root_mode():
    spawner = Spawner()
    spawner.fork()

from .agent import main  # noqa: E402  (after the fork: see above)

main(spawner)
