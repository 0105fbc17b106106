#!/usr/bin/env bash
# Checks that every relative link in README.md and docs/*.md (or in the Markdown files
# given as arguments) names an existing file, and that a #fragment names a heading of
# the target as GitHub renders its anchor. Links to http(s) and mailto are not followed.
# Exits non-zero, listing each broken link as FILE:LINE: TARGET (why).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then set -- README.md docs/*.md; fi
exec python3 - "$@" <<'PY'
import os, re, sys, unicodedata

LINK = re.compile(r'(?<!\!)\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')
FENCE = re.compile(r'^\s*(```|~~~)')

def outside_fences(path):
    """(line number, line) of the lines outside fenced code blocks."""
    in_fence = None
    with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
            m = FENCE.match(line)
            if m:
                if in_fence is None:
                    in_fence = m.group(1)
                elif m.group(1) == in_fence:
                    in_fence = None
                continue
            if in_fence is None:
                yield n, line

def prose_lines(path):
    """(line number, text) of the lines outside fenced code blocks, inline code removed."""
    for n, line in outside_fences(path):
        yield n, re.sub(r'`[^`]*`', '', line)

def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', heading)  # a link keeps its text
    text = text.strip().lower()
    out = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in ' -_' or cat[0] in 'LN' or cat == 'Mn':
            out.append('-' if ch == ' ' else ch)
    return ''.join(out)

anchors_of = {}
def anchors(path):
    if path not in anchors_of:
        seen, found = {}, set()
        for _, line in headings(path):
            s = slug(line)
            k = seen.get(s, 0)
            seen[s] = k + 1
            found.add(s if k == 0 else f'{s}-{k}')
        anchors_of[path] = found
    return anchors_of[path]

def headings(path):
    for n, line in outside_fences(path):
        h = re.match(r'^#{1,6}\s+(.*?)\s*#*\s*$', line)
        if h:
            yield n, h.group(1)

broken = 0
checked = 0
for md in sys.argv[1:]:
    base = os.path.dirname(md)
    for n, line in prose_lines(md):
        for target in LINK.findall(line):
            if re.match(r'^[a-z][a-z0-9+.-]*:', target, re.I):
                continue  # http:, https:, mailto:
            checked += 1
            path, _, frag = target.partition('#')
            dest = os.path.normpath(os.path.join(base, path)) if path else md
            why = None
            if not os.path.exists(dest):
                why = 'no such file'
            elif frag and dest.endswith('.md') and frag not in anchors(dest):
                why = f'no heading with anchor #{frag} in {dest}'
            if why:
                broken += 1
                print(f'{md}:{n}: {target} ({why})')
if broken:
    print(f'check_links: {broken} of {checked} relative links broken', file=sys.stderr)
    sys.exit(1)
print(f'check_links: {checked} relative links in {len(sys.argv) - 1} files resolve')
PY
