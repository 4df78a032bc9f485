#!/usr/bin/env python3
"""Checks that every relative link in the repository's Markdown files resolves.

    tests/docs/check_links.py [REPO_ROOT]

A link `[text](path)` or `[text](path#anchor)` must name a file or folder that exists, relative
to the Markdown file; `#anchor` must be a heading of the target Markdown file, spelled as GitHub
spells heading anchors (lower case, punctuation dropped, spaces as '-', '-1', '-2' for repeats).
Links with a scheme (http:, https:, mailto:) are not checked. Prints each broken link as
FILE:LINE: LINK (why) and exits 1 if there is any, else 0.
"""
import os
import re
import subprocess
import sys

LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')
HEADING = re.compile(r'^(#{1,6})\s+(.*?)\s*#*\s*$')


def slug(text):
    text = re.sub(r'`([^`]*)`', r'\1', text)
    text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', text)
    text = text.strip().lower()
    text = re.sub(r'[^\w\- ]', '', text)
    return text.replace(' ', '-')


def anchors(path, cache={}):
    if path not in cache:
        found, seen, fence = set(), {}, False
        with open(path, encoding='utf-8') as f:
            for line in f:
                if line.lstrip().startswith('```'):
                    fence = not fence
                    continue
                m = None if fence else HEADING.match(line)
                if m:
                    s = slug(m.group(2))
                    n = seen.get(s, 0)
                    seen[s] = n + 1
                    found.add(s if n == 0 else f'{s}-{n}')
        cache[path] = found
    return cache[path]


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), '..', '..'))
    files = subprocess.run(['git', '-C', root, 'ls-files', '--cached', '--others',
                            '--exclude-standard', '*.md'],
                           capture_output=True, text=True, check=True).stdout.split()
    broken = 0
    for rel in files:
        path = os.path.join(root, rel)
        if not os.path.exists(path):
            continue
        fence = False
        with open(path, encoding='utf-8') as f:
            for number, line in enumerate(f, 1):
                if line.lstrip().startswith('```'):
                    fence = not fence
                    continue
                if fence:
                    continue
                for target in LINK.findall(line):
                    if re.match(r'^[a-z]+:', target):
                        continue
                    file_part, _, anchor = target.partition('#')
                    dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) \
                        if file_part else path
                    why = None
                    if not os.path.exists(dest):
                        why = 'no such file'
                    elif anchor and dest.endswith('.md') and anchor not in anchors(dest):
                        why = 'no such heading'
                    if why:
                        print(f'{rel}:{number}: {target} ({why})')
                        broken += 1
    return 1 if broken else 0


if __name__ == '__main__':
    sys.exit(main())
