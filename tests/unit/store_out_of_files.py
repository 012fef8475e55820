"""A weight-broadcast store in a process that runs out of file descriptors, then gets them back (issue 52: one
failed `accept` ended the store for the rest of the run while its socket kept listening).

`store_out_of_files.py KEY_HEX` prints the store's port; on "fill" from stdin lowers the open-file limit and opens /dev/null until EMFILE, printing
"full"; on "free" closes them again, printing "freed"; exits at the end of stdin. The store logs to stderr."""

import os
import resource
import sys

from prime_rl.weight_broadcast.store import StoreServer


def main() -> None:
    server = StoreServer("127.0.0.1", 0, bytes.fromhex(sys.argv[1]))
    print(server.port, flush=True)
    filler: list[int] = []
    for line in sys.stdin:
        if line.strip() == "fill":
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
            try:
                while True:
                    filler.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass  # EMFILE: every descriptor this process may have is taken
            print("full", flush=True)
        elif line.strip() == "free":
            for fd in filler:
                os.close(fd)
            filler.clear()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            print("freed", flush=True)
    server.close()


if __name__ == "__main__":
    main()
