#!/usr/bin/env bash
# Fails on a function in src/ or include/ longer than 80 lines (from its first line to its
# closing brace, as universal-ctags finds them) unless it is listed in
# scripts/check_function_size.allow, which may only shrink: a listed function that is now
# 80 lines or fewer, or gone, fails too. Prints how many there are, and the longest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - <<'PY'
import json, subprocess, sys

LIMIT = 80
tags = subprocess.run(['ctags', '-R', '--languages=C++', '--kinds-C++=f', '--fields=+ne',
                       '--output-format=json', '-o', '-', 'src', 'include'],
                      check=True, capture_output=True, text=True).stdout
long = {}
for line in tags.splitlines():
    tag = json.loads(line)
    length = tag['end'] - tag['line'] + 1
    # "path Class::name" for a member, "path name" otherwise: namespaces, named or
    # anonymous, are left out.
    owner = tag['scope'].split('::')[-1] + '::' if tag.get('scopeKind') in ('class', 'struct') else ''
    name = f"{tag['path']} {owner}{tag['name']}"
    if length > LIMIT:
        long[name] = max(length, long.get(name, 0))

allow_file = 'scripts/check_function_size.allow'
allowed = {l.strip() for l in open(allow_file) if l.strip() and not l.startswith('#')}
new, gone = sorted(set(long) - allowed), sorted(allowed - set(long))
for name in new:
    print(f'check_function_size: {name} is {long[name]} lines, over {LIMIT}: split it')
for name in gone:
    print(f'check_function_size: {name} is in {allow_file} but no longer over {LIMIT} lines: delete its line')
longest = ', '.join(f'{n.split()[1]} {l}' for n, l in sorted(long.items(), key=lambda x: -x[1])[:3])
print(f'check_function_size: {len(long)} functions over {LIMIT} lines, {len(allowed)} allowed; longest {longest}')
sys.exit(1 if new or gone else 0)
PY
