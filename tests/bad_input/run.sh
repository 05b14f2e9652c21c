#!/usr/bin/env bash
# The bad-input corpus: every file under config/ (simulate --config FILE), placement/ (plan --resident FILE)
# and cli/ (one command line, @LOADS@ and @WORK@ substituted) must be refused with the exit code of
# expect.tsv and a message on stderr matching its pattern, which names the offending value. Each case runs
# with a time limit and, unless MEM_KB is 0 (sanitizer builds reserve huge address spaces), a memory limit.
# usage: run.sh FOREMOE_BINARY [MEM_KB]
set -uo pipefail
bin=$1
mem_kb=${2:-2000000}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0
failed=0
fail() {
  echo "FAIL: $*"
  failed=$((failed + 1))
}

# A tiny valid load file: 1 micro-step x 1 layer x 8 experts (the placements are for 1 x 8 GPUs x 2 slots).
if ! "$bin" trace gen --layers 1 --experts 8 --topk 2 --steps 1 --prompts 4 --loads "$work/loads.npy" >/dev/null; then
  echo "FAIL: could not generate the load file"
  exit 1
fi

declare -A want_code want_pattern
while IFS=$'\t' read -r file code pattern; do
  [[ -z "$file" || "$file" == \#* ]] && continue
  want_code[$file]=$code
  want_pattern[$file]=$pattern
done <"$here/expect.tsv"

# Every case file has an expectation and every expectation a file: no case is skipped silently.
cases=()
for f in "$here"/config/*.json "$here"/placement/*.json "$here"/cli/*.args; do
  rel=${f#"$here"/}
  [[ -v "want_code[$rel]" ]] || fail "$rel has no line in expect.tsv"
  cases+=("$rel")
done
for rel in "${!want_code[@]}"; do
  [[ -f "$here/$rel" ]] || fail "expect.tsv names $rel, which does not exist"
done

for rel in "${cases[@]}"; do
  [[ -v "want_code[$rel]" ]] || continue
  case $rel in
  config/*) cmd=(simulate --config "$here/$rel") ;;
  placement/*) cmd=(plan --loads "$work/loads.npy" --nodes 1 --gpus-per-node 8 --slots 2 --resident "$here/$rel") ;;
  cli/*)
    line=$(<"$here/$rel")
    line=${line//@LOADS@/$work/loads.npy}
    line=${line//@WORK@/$work}
    read -r -a cmd <<<"$line"
    ;;
  esac
  (
    [[ $mem_kb -gt 0 ]] && ulimit -v "$mem_kb"
    exec timeout 10 "$bin" "${cmd[@]}"
  ) >"$work/out" 2>"$work/err"
  rc=$?
  err=$(<"$work/err")
  if [[ $rc -eq 124 ]]; then
    fail "$rel: still running after 10 s (foremoe ${cmd[*]})"
  elif [[ $rc -ne ${want_code[$rel]} ]]; then
    fail "$rel: exit $rc, want ${want_code[$rel]} (foremoe ${cmd[*]}); stderr: ${err:0:400}"
  elif ! grep -Eq -- "${want_pattern[$rel]}" <<<"$err"; then
    fail "$rel: stderr does not match /${want_pattern[$rel]}/: ${err:0:400}"
  elif grep -q "unexpected error" <<<"$err"; then
    fail "$rel: an unexpected error instead of a refusal: ${err:0:400}"
  else
    passed=$((passed + 1))
  fi
done

echo "bad input: $passed refused as expected, $failed failed"
[[ $failed -eq 0 && $passed -gt 0 ]]
