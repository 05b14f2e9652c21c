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

# A tiny valid load file: 1 micro-step x 1 layer x 8 experts (the placements are for 1 x 8 GPUs x 2 slots), routed
# ids, a placement and a config file: the inputs the cases name (and must leave as they were).
setup() {
  "$bin" trace gen --layers 1 --experts 8 --topk 2 --steps 1 --prompts 4 --loads "$work/loads.npy" &&
    "$bin" trace gen --layers 1 --experts 8 --topk 2 --steps 1 --prompts 4 --ids "$work/ids.npy" &&
    "$bin" plan --loads "$work/loads.npy" --nodes 1 --gpus-per-node 8 --slots 2 --out-placement "$work/res.json" &&
    echo '{"batch": {"steps": 1}}' >"$work/cfg.json" &&
    ln -s loads.npy "$work/link.npy" && mkfifo "$work/fifo"
} >/dev/null
if ! setup; then
  echo "FAIL: could not make the input files"
  exit 1
fi
# Inputs of sizes nobody should have to commit: a 200,001-key object whose last key repeats the first (the
# duplicate check must be linear), a 10 MB string, key and number (messages must cut what they quote), and a
# sparse 8 MB load file of 1,048,575 experts (its header written here, its zeros a hole).
awk 'BEGIN { printf "{"; for (i = 0; i < 200000; i++) printf "\"k%d\": 0, ", i; printf "\"k0\": 1}" }' >"$work/many_keys.json"
run_of() { head -c 10000000 /dev/zero | tr '\0' "$1"; } # 10 MB of one character, never held in a variable
{ printf '{"strategies": "'; run_of x; printf '"}'; } >"$work/huge_string.json"
{ printf '{"'; run_of x; printf '": 1}'; } >"$work/huge_key.json"
{ printf '{"batch": {"steps": 1'; run_of 1; printf '}}'; } >"$work/huge_number.json"
{
  dict="{'descr': '<f8', 'fortran_order': False, 'shape': (1, 1048575), }"
  pad=$((128 - 10 - ${#dict} - 1))
  printf '\x93NUMPY\x01\x00\x76\x00%s%*s\n' "$dict" "$pad" ""
} >"$work/sparse.npy"
truncate -s $((128 + 8 * 1048575)) "$work/sparse.npy"
# Routed ids [2 tokens, 8193 layers, top-1] int8, all expert 0 (a hole): with 32,767 experts, per-sequence
# histograms of 2 x 8193 x 32767 cells (plan --ids).
{
  dict="{'descr': '|i1', 'fortran_order': False, 'shape': (2, 8193, 1), }"
  pad=$((128 - 10 - ${#dict} - 1))
  printf '\x93NUMPY\x01\x00\x76\x00%s%*s\n' "$dict" "$pad" ""
} >"$work/deep_ids.npy"
truncate -s $((128 + 2 * 8193)) "$work/deep_ids.npy"
# What every case must leave as it was: the inputs, byte for byte, the folder's listing (a refused command writes
# nothing) and the device nodes a case names.
mkdir "$work/pristine"
for f in loads.npy ids.npy res.json cfg.json; do cp "$work/$f" "$work/pristine/$f"; done
listing() { (cd "$work" && ls -A | grep -v -e '^out$' -e '^err$'); }
listing >"$work/pristine/listing"

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
    line=${line//@FIFO@/$work/fifo}
    line=${line//@DATA@/$here/data}
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
  elif [[ ${#err} -gt 4096 ]]; then
    fail "$rel: a message of ${#err} characters (quotes must be cut): ${err:0:400}"
  elif ! listing | cmp -s - "$work/pristine/listing"; then
    fail "$rel: left files behind or removed some: $(listing | diff "$work/pristine/listing" - | tr '\n' ' ')"
  elif [[ ! -c /dev/null || ! -c /dev/full || ! -p "$work/fifo" ]]; then
    fail "$rel: replaced a device node or the FIFO by a regular file"
  else
    passed=$((passed + 1))
  fi
  for f in loads.npy ids.npy res.json cfg.json; do
    cmp -s "$work/$f" "$work/pristine/$f" || fail "$rel: changed the input $f"
    cp "$work/pristine/$f" "$work/$f"
  done
done

# Outputs that exist and are not regular files are written in place, never replaced: a FIFO with a reader gets the
# bytes and stays a FIFO, /dev/null stays a device.
mkfifo "$work/out_fifo"
cat "$work/out_fifo" >"$work/from_fifo" &
reader=$!
if ! timeout 10 "$bin" plan --loads "$work/loads.npy" --nodes 1 --gpus-per-node 8 --slots 2 --out "$work/out_fifo" \
  >/dev/null 2>"$work/err"; then
  fail "plan --out FIFO: $(<"$work/err")"
fi
wait "$reader"
if [[ ! -p "$work/out_fifo" ]] || ! grep -q '"micro_steps"' "$work/from_fifo"; then
  fail "plan --out FIFO: the FIFO was replaced or did not get the plan"
else
  passed=$((passed + 1))
fi
if ! timeout 10 "$bin" trace gen --layers 1 --experts 8 --steps 1 --prompts 2 --loads /dev/null >/dev/null 2>"$work/err" ||
  [[ ! -c /dev/null ]]; then
  fail "trace gen --loads /dev/null: $(<"$work/err")"
else
  passed=$((passed + 1))
fi

echo "bad input: $passed refused as expected, $failed failed"
[[ $failed -eq 0 && $passed -gt 0 ]]
