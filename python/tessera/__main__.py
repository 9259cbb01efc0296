"""python -m tessera [info | version]"""
import sys

from . import __version__, info

USAGE = "usage: python -m tessera [info | version]"


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cmd = args[0] if args else "info"
    if cmd in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if cmd == "info":
        sys.stdout.write(info())
        return 0
    if cmd == "version":
        print(__version__)
        return 0
    print("tessera: unknown command '%s' (%s)" % (cmd, USAGE), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
