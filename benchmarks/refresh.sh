#!/bin/bash
# Every figure of README.md and notes/ from its command, in one go: rewrites notes/measured/ and its INDEX.md.
# The parts, their commands and the header each file gets are in benchmarks/refresh.py.
#   bash benchmarks/refresh.sh                 # every part this machine can run (hours: each part's time in INDEX.md)
#   bash benchmarks/refresh.sh --quick         # a smoke run: tiny sizes, into a temporary folder
#   bash benchmarks/refresh.sh --only default_4x2 explain_3x2    # some parts (--list names them)
exec "${PYTHON:-python}" "$(dirname "$0")/refresh.py" "$@"
