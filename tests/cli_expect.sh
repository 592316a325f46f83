#!/bin/sh
# Runs a command and checks its exit code and output; used by tests/cli.cmake.
#
# Usage: cli_expect.sh --exit N [--stderr-lines N] [--stdout ERE] [--stderr ERE]
#                      [--stdout-json PYTHON_EXPR] -- COMMAND [ARGS...]
#   --exit N            the exit code the command must return
#   --stderr-lines N    stderr must have exactly N lines
#   --stdout ERE        some stdout line must match the extended regex (repeatable: every
#                       pattern given must match)
#   --stderr ERE        some stderr line must match the extended regex (repeatable)
#   --stdout-json EXPR  stdout must be one JSON document (python3 json.load), and EXPR, evaluated
#                       with the document bound to d, must be true ("True": validity only)
# Prints what it saw on failure, so ctest --output-on-failure shows the reason.
set -u
want_exit=""; want_lines=""; want_stdout=""; want_stderr=""; want_json=""
while [ $# -gt 0 ]; do
  case "$1" in
    --exit) want_exit=$2; shift 2 ;;
    --stderr-lines) want_lines=$2; shift 2 ;;
    --stdout) want_stdout="$want_stdout$2
"; shift 2 ;;
    --stderr) want_stderr="$want_stderr$2
"; shift 2 ;;
    --stdout-json) want_json=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "cli_expect.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if [ -z "$want_exit" ] || [ $# -eq 0 ]; then
  echo "cli_expect.sh: need --exit N and a command after --" >&2; exit 2
fi

tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
"$@" >"$tmp/out" 2>"$tmp/err"
got_exit=$?

failed=0
problem() { echo "FAIL: $*"; failed=1; }
[ "$got_exit" -eq "$want_exit" ] || problem "exit code $got_exit, expected $want_exit"
if [ -n "$want_lines" ]; then
  got_lines=$(wc -l <"$tmp/err" | tr -d ' ')
  # A last line without a newline still counts as a line.
  if [ -s "$tmp/err" ] && [ "$(tail -c 1 "$tmp/err" | od -An -c | tr -d ' ')" != '\n' ]; then
    got_lines=$((got_lines + 1))
  fi
  [ "$got_lines" -eq "$want_lines" ] || problem "$got_lines stderr lines, expected $want_lines"
fi
# Each accumulated pattern (one per line) must match some line of its stream.
check_patterns() {  # patterns file stream-name
  printf '%s' "$1" | while IFS= read -r pat; do
    [ -n "$pat" ] || continue
    grep -Eq -- "$pat" "$2" || echo "no $3 line matches: $pat"
  done
}
misses=$(check_patterns "$want_stdout" "$tmp/out" stdout; check_patterns "$want_stderr" "$tmp/err" stderr)
[ -z "$misses" ] || problem "$misses"
if [ -n "$want_json" ]; then
  python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
sys.exit(0 if eval(sys.argv[2], {"d": d}) else 1)
' "$tmp/out" "$want_json" || problem "stdout is not JSON satisfying: $want_json"
fi

if [ "$failed" -ne 0 ]; then
  echo "command: $*"
  echo "--- stdout (first 40 lines) ---"; head -n 40 "$tmp/out"
  echo "--- stderr ---"; cat "$tmp/err"
  exit 1
fi
exit 0
