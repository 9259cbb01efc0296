#!/usr/bin/env bash
# Compares the machine code (SASS) of every kernel of two builds, function by function: the check
# that a refactoring of device code left the kernels as they were. Needs no GPU.
#   scripts/compare_sass.sh BASE_BUILD NEW_BUILD [OBJECT_FILTER]
# BASE_BUILD / NEW_BUILD: two CMake build folders configured with the same flags (for example the
# parent commit's and this one's, each with -DTESSERA_PORTABLE_ARCHS=90-real). Every object of the
# device-code targets (tessera_kernels_portable, tessera_kernels_hopper) found in both is dumped
# with cuobjdump; OBJECT_FILTER (an extended regex) keeps only the object paths that match it.
# Per function it prints one of
#   identical         the same instructions and the same encodings (scheduling bits included)
#   schedule differs  the same instructions; only the control bits (stalls, barriers) differ
#   reordered         the same opcodes (with modifiers) in another order or on other registers
#   DIFFERS           the instruction lists differ: their lengths and how many lines differ
# and, where they changed, the registers and the stack frame (spills) of cuobjdump -res-usage.
# Exit status 0 when every function is identical and the registers and stack did not grow.
# Environment: KEEP=DIR keeps the per-function listings there (DIR/{base,new}/...), for diff -u.
# cuobjdump and nvdisasm: the toolkit's, or the pinned PyPI wheels of scripts/requirements-sass-tools.txt.
set -euo pipefail
base=${1:?usage: compare_sass.sh BASE_BUILD NEW_BUILD [OBJECT_FILTER]}
new=${2:?usage: compare_sass.sh BASE_BUILD NEW_BUILD [OBJECT_FILTER]}
filter=${3:-.}
cuda_bin="${CUDA_HOME:-/usr/local/cuda}/bin"
[ -d "$cuda_bin" ] && PATH="$PATH:$cuda_bin"
command -v cuobjdump >/dev/null || { echo "compare_sass: cuobjdump not found (put it on PATH or set CUDA_HOME)" >&2; exit 2; }

work=${KEEP:-$(mktemp -d)}
[ -n "${KEEP:-}" ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work/base" "$work/new"

# One file per (arch, function) under $2: NAME.ins (instruction text) and NAME.enc (instruction and
# both encoding words). Addresses are dropped; the anonymous-namespace tag in mangled names (it
# depends on the source path) is replaced by a fixed one.
norm='
  # The mangled anonymous namespace <len>_GLOBAL__N__<tag> (its tag depends on the source path)
  # becomes the plain 12_GLOBAL__N_1, cut by its length prefix.
  function norm(name,   at, len, digits) {
    while ((at = index(name, "_GLOBAL__N__")) > 0) {
      digits = substr(name, 1, at - 1); match(digits, /[0-9]+$/)
      len = substr(digits, RSTART) + 0
      name = substr(name, 1, RSTART - 1) "12_GLOBAL__N_1" substr(name, at + len)
    }
    return name
  }'
split_sass() {
  cuobjdump -sass "$1" | awk -v out="$2" "$norm"'
    /^arch = / { arch = $3 }
    /^[ \t]*Function : / { if (ins) { close(ins); close(enc) } name = arch "." norm($3); ins = out "/" name ".ins"; enc = out "/" name ".enc"; printf "" > ins; printf "" > enc; next }
    ins && /^[ \t]*\/\*[0-9a-f]+\*\// {
      line = $0; sub(/^[ \t]*\/\*[0-9a-f]+\*\/[ \t]*/, "", line)
      code = line; sub(/[ \t]*\/\*.*$/, "", code); gsub(/[ \t]+/, " ", code)
      word = line; sub(/^.*\/\* */, "", word); sub(/ *\*\/.*$/, "", word)
      print code > ins; pending = code " " word; next
    }
    ins && pending != "" && /^[ \t]*\/\* 0x[0-9a-f]+ \*\/[ \t]*$/ {
      word = $0; gsub(/[ \t\/*]/, "", word); print pending " " word > enc; pending = ""; next
    }'
}
# The sorted multiset of a listing's opcodes (with modifiers, without operands): equal for two
# listings that differ only in register names and the order of instructions.
opcodes() { awk '{ op = ($1 ~ /^@/) ? $2 : $1; print op }' "$1" | sort; }
# "ARCH.NAME REG STACK" lines of cuobjdump -res-usage.
resources() {
  cuobjdump -res-usage "$1" | awk "$norm"'
    /^arch = / { arch = $3 }
    /^[ \t]*Function / { name = $2; sub(/:$/, "", name); name = arch "." norm(name); next }
    name && /REG:/ { reg = $1; stack = $2; sub(/REG:/, "", reg); sub(/STACK:/, "", stack); print name, reg, stack; name = "" }' | sort -u
}

# ARCH.MANGLED as "ARCH name<args>" without the library's namespaces and the parameter list.
pretty() {
  local arch=${1%%.*} name=${1#*.}
  if command -v c++filt >/dev/null; then
    name=$(echo "$name" | c++filt | sed -E 's/tessera::kernels::(sm80::|sm90::|\(anonymous namespace\)::)?//g; s/\([^()]*\)$//; s/^void //')
  fi
  echo "$arch $name"
}

status=0
identical=0
total=0
objects=$(cd "$base" && find CMakeFiles/tessera_kernels_portable.dir CMakeFiles/tessera_kernels_hopper.dir \
  -name '*.cu.o' 2>/dev/null | sort | grep -E "$filter" || true)
[ -n "$objects" ] || { echo "compare_sass: no kernel objects in $base" >&2; exit 2; }
for obj in $objects; do
  if [ ! -f "$new/$obj" ]; then echo "== $obj: missing in $new"; status=1; continue; fi
  tag=$(echo "$obj" | tr '/' '_')
  mkdir -p "$work/base/$tag" "$work/new/$tag"
  split_sass "$base/$obj" "$work/base/$tag"
  split_sass "$new/$obj" "$work/new/$tag"
  resources "$base/$obj" > "$work/base/$tag/resources"
  resources "$new/$obj" > "$work/new/$tag/resources"
  echo "== $obj"
  for f in $( (cd "$work/base/$tag" && ls *.ins; cd "$work/new/$tag" && ls *.ins) | sort -u); do
    fn=${f%.ins}
    total=$((total + 1))
    short=$(pretty "$fn")
    b="$work/base/$tag/$fn" n="$work/new/$tag/$fn"
    if [ ! -f "$b.ins" ] || [ ! -f "$n.ins" ]; then
      echo "  ONLY IN $([ -f "$b.ins" ] && echo base || echo new): $short"; status=1; continue
    fi
    if cmp -s "$b.enc" "$n.enc"; then
      verdict="identical"; identical=$((identical + 1))
    elif cmp -s "$b.ins" "$n.ins"; then
      verdict="schedule differs"; status=1
    elif cmp -s <(opcodes "$b.ins") <(opcodes "$n.ins"); then
      changed=$(diff "$b.ins" "$n.ins" | grep -c '^[<>]' || true)
      verdict="reordered: the same $(wc -l < "$b.ins") opcodes, $changed lines changed"; status=1
    else
      changed=$(diff "$b.ins" "$n.ins" | grep -c '^[<>]' || true)
      verdict="DIFFERS: $(wc -l < "$b.ins") -> $(wc -l < "$n.ins") instructions, $changed lines changed"; status=1
    fi
    rb=$(awk -v n="$fn" '$1 == n { print $2, $3 }' "$work/base/$tag/resources")
    rn=$(awk -v n="$fn" '$1 == n { print $2, $3 }' "$work/new/$tag/resources")
    res=""
    if [ "$rb" != "$rn" ]; then
      res="  [REG STACK $rb -> $rn]"
      read -r reg_b stack_b <<< "$rb"; read -r reg_n stack_n <<< "$rn"
      if [ "${reg_n:-0}" -gt "${reg_b:-0}" ] || [ "${stack_n:-0}" -gt "${stack_b:-0}" ]; then status=1; fi
    fi
    echo "  $verdict$res  $short"
  done
done
echo "compare_sass: $identical of $total functions identical"
exit $status
