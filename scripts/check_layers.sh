#!/usr/bin/env bash
# Fails on an include that climbs the layer order of docs/architecture.md ("Layers": the
# order and the table of public headers), unless it is listed in scripts/check_layers.allow,
# which may only shrink: a listed include that no longer climbs (or is gone) fails too.
# Prints how many climbing includes there are.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - <<'PY'
import pathlib, re, sys

doc = pathlib.Path('docs/architecture.md').read_text()
section = doc.split('\n## Layers\n', 1)[1].split('\n## ', 1)[0]
order = re.search(r'```\n(.*?)```', section, re.S).group(1)
tiers = [re.findall(r'\w+', tier) for tier in order.split('>')]
height = {name: len(tiers) - i for i, tier in enumerate(tiers) for name in tier}
table = dict(re.findall(r'^\| `(remat/[\w/]+\.h)` \| (\w+) \|$', section, re.M))

def layer(path):
    """The layer of a file under src/ or include/, or None for src/pch.h and the like."""
    parts = path.parts
    if parts[0] == 'include':
        header = '/'.join(parts[1:])
        return table.get(header, parts[2].removesuffix('.h'))
    return parts[1] if len(parts) > 2 else None

files = sorted(p for p in [*pathlib.Path('src').rglob('*'), *pathlib.Path('include').rglob('*')]
               if p.suffix in ('.h', '.cpp'))
unplaced = [f for f in files if layer(f) and layer(f) not in height]
for f in unplaced:
    print(f'check_layers: {f} is in layer "{layer(f)}", which is not in the order of docs/architecture.md '
          '("Layers"): place its folder there, or a public header in the table')
if unplaced:
    sys.exit(1)

climbing = set()
for f in files:
    for name in re.findall(r'^#include "([^"]+)"', f.read_text(), re.M):
        target = next((p for p in (pathlib.Path('include', name), pathlib.Path('src', name), f.parent / name)
                       if p.exists()), None)
        if target is None:
            sys.exit(f'check_layers: {f} includes "{name}", which is in neither include/, src/ nor {f.parent}/')
        if layer(f) and layer(target) and height[layer(target)] > height[layer(f)]:
            climbing.add(f'{f} -> {name}')

allow_file = pathlib.Path('scripts/check_layers.allow')
allowed = {line.strip() for line in allow_file.read_text().splitlines() if line.strip() and not line.startswith('#')}
new, gone = sorted(climbing - allowed), sorted(allowed - climbing)
for arrow in new:
    print(f'check_layers: {arrow} climbs the layer order (docs/architecture.md, "Layers")')
for arrow in gone:
    print(f'check_layers: {arrow} is in {allow_file} but no longer climbs: delete its line')
print(f'check_layers: {len(climbing)} includes climb the layer order, {len(allowed)} allowed')
sys.exit(1 if new or gone else 0)
PY
