"""allreduce_loop.py with the one line that turns hang detection on: a heartbeat every iteration."""

import resilient_train as rt
from allreduce_loop import main

if __name__ == "__main__":
    main(beat=rt.heartbeat)
