import os

# Inductor's compile workers are subprocesses; on a 2-core machine one is enough.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
