#!/usr/bin/env python3
"""The documentation's links and the code's citations of docs/design.md.

Checks, for a source tree:
  - every relative link and image in README.md and docs/*.md names an existing file or folder, and a #anchor into a
    markdown file names one of its headings (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens, a
    repeated heading gets -1, -2, ...);
  - README.md is at most 12 KiB (12,288 bytes): a front page, the manual lives in docs/;
  - the headings of docs/design.md are unique (code cites them by name);
  - every citation `design.md, "Heading"` (or `design.md, section "Heading"`) in *.h, *.cc, *.cu and *.py files
    names an existing heading of docs/design.md; a citation may wrap across comment lines.
With --forbid-numbered, a citation by section number (`design.md section 8.1`) is an error too.

Usage: check_docs.py SOURCE_DIR [--forbid-numbered]; check_docs.py --self-test (each rule fails on a broken tree).
Exit status 0 when everything holds, 1 with one line per problem otherwise.
"""

import os
import re
import shutil
import sys
import tempfile

README_LIMIT = 12288
CODE_SUFFIXES = (".h", ".cc", ".cu", ".py")
SKIP_DIRS = {".git", "build", "node_modules", "__pycache__"}
SKIP_FILES = {os.path.join("tests", "docs", "check_docs.py")}  # this checker: its examples are not citations


def strip_code(text, inline=True):
    """The markdown text with fenced code blocks (and, with inline, code spans) blanked; line numbers kept."""
    out, fence = [], None
    for line in text.split("\n"):
        m = re.match(r"^\s*(```+|~~~+)", line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
            out.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
            continue
        out.append(re.sub(r"`+[^`]*`+", lambda s: " " * len(s.group(0)), line) if inline else line)
    return out


def github_slug(heading):
    """GitHub's anchor of a heading's text: formatting removed, lower case, only letters, digits, spaces, hyphens
    and underscores kept, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = text.replace("`", "")
    text = re.sub(r"<[^>]+>", "", text)
    s = text.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def headings(path):
    """The headings of a markdown file, in order (outside code blocks)."""
    result = []
    for line in strip_code(open(path, encoding="utf-8").read(), inline=False):
        m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            result.append(m.group(2))
    return result


def anchors(path):
    seen, result = {}, set()
    for h in headings(path):
        slug = github_slug(h)
        n = seen.get(slug, 0)
        result.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return result


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")


def links(path):
    """(line number, target) of every inline link, image and reference definition, outside code."""
    result = []
    for n, line in enumerate(strip_code(open(path, encoding="utf-8").read()), 1):
        for m in LINK.finditer(line):
            result.append((n, m.group(1)))
        m = REF_DEF.match(line)
        if m:
            result.append((n, m.group(1)))
    return result


def check_links(root, md_files):
    problems = []
    cache = {}
    for md in md_files:
        rel_md = os.path.relpath(md, root)
        for n, target in links(md):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = md if path_part == "" else os.path.normpath(os.path.join(os.path.dirname(md), path_part))
            if not os.path.exists(dest):
                problems.append(f"{rel_md}:{n}: link to {target}: {os.path.relpath(dest, root)} does not exist")
                continue
            if anchor and dest.endswith(".md"):
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    problems.append(f"{rel_md}:{n}: link to {target}: {os.path.relpath(dest, root)} has no heading "
                                    f"with the anchor #{anchor}")
    return problems


# A heading cited in a comment; it may wrap onto the next comment line (//, # or *), and is at most 100 characters.
CITATION = re.compile(r"design\.md,?[ \t]*(?:section[ \t]+)?\"((?:[^\"\n]|\n[ \t]*(?://+|#+|\*+)[ \t]*){1,100})\"")
NUMBERED = re.compile(r"design\.md,?\s*(?://+|#+|\*+)?\s*sections?\s+\d+(?:\.\d+)*")


def code_files(root):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("build"))
        for f in sorted(filenames):
            path = os.path.join(dirpath, f)
            if f.endswith(CODE_SUFFIXES) and os.path.relpath(path, root) not in SKIP_FILES:
                yield path


def check_citations(root, forbid_numbered):
    problems = []
    design = os.path.join(root, "docs", "design.md")
    if not os.path.exists(design):
        return [f"docs/design.md does not exist"]
    names = headings(design)
    dupes = sorted({h for h in names if names.count(h) > 1})
    for h in dupes:
        problems.append(f"docs/design.md: the heading \"{h}\" appears {names.count(h)} times (code cites headings by "
                        "name: make it unique)")
    known = set(names)
    for path in code_files(root):
        try:
            text = open(path, encoding="utf-8").read()
        except UnicodeDecodeError:
            continue
        rel = os.path.relpath(path, root)
        for m in CITATION.finditer(text):
            name = re.sub(r"\s*\n[ \t]*(?://+|#+|\*+)[ \t]*", " ", m.group(1)).strip()
            if name not in known:
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{rel}:{line}: cites docs/design.md, \"{name}\", which is not a heading of "
                                "docs/design.md")
        if forbid_numbered:
            for m in NUMBERED.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{rel}:{line}: cites docs/design.md by section number ({' '.join(m.group(0).split())}"
                                "); cite the heading: design.md, \"Heading\"")
    return problems


def check(root, forbid_numbered=False):
    problems = []
    readme = os.path.join(root, "README.md")
    if not os.path.exists(readme):
        return ["README.md does not exist"]
    size = os.path.getsize(readme)
    if size > README_LIMIT:
        problems.append(f"README.md is {size} bytes, more than {README_LIMIT}: move the detail into docs/")
    docs = os.path.join(root, "docs")
    md_files = [readme] + sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    problems += check_links(root, md_files)
    problems += check_citations(root, forbid_numbered)
    return problems


def self_test():
    """Each rule must fail on a tree that breaks it, and a tree that keeps them must pass."""
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        def tree(readme, design, code, other=""):
            shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, "docs"))
            os.makedirs(os.path.join(tmp, "src"))
            open(os.path.join(tmp, "README.md"), "w").write(readme)
            open(os.path.join(tmp, "docs", "design.md"), "w").write(design)
            open(os.path.join(tmp, "docs", "other.md"), "w").write(other)
            open(os.path.join(tmp, "src", "a.h"), "w").write(code)
            return check(tmp, forbid_numbered=True)

        design = "# Design\n\n## Ring attention\n\n### Zigzag layout: why\n\n## `sp_bench` JSON\n\n## Ring attention (p2p)\n"
        good_readme = ("See [design](docs/design.md#ring-attention), [zigzag](docs/design.md#zigzag-layout-why), "
                       "[json](docs/design.md#sp_bench-json), [p2p](docs/design.md#ring-attention-p2p), "
                       "[other](docs/other.md), [web](https://example.org/x#y), [self](#readme), ![img](docs/).\n"
                       "`[not a link](nowhere.md)`\n\n```\n[nor this](nowhere.md)\n```\n# Readme\n")
        good_code = '// math: docs/design.md, "Ring attention"; tiles: docs/design.md, "Zigzag layout:\n// why".\n'
        cases = [
            ("a tree that keeps every rule", good_readme, design, good_code, "[up](../README.md#readme)\n", 0),
            ("a link to a missing file", good_readme + "[x](docs/missing.md)\n", design, good_code, "", 1),
            ("a link to a missing anchor", good_readme + "[x](docs/design.md#no-such-heading)\n", design, good_code,
             "", 1),
            ("a missing anchor in the same file", good_readme, design, good_code, "[x](#nowhere)\n", 1),
            ("a link up to a missing file", good_readme, design, good_code, "[x](../LICENSE)\n", 1),
            ("a README over 12 KiB", good_readme + "x" * README_LIMIT, design, good_code, "", 1),
            ("a citation of a missing heading", good_readme, design, good_code + '// docs/design.md, "Ring"\n', "", 1),
            ("a wrapped citation of a missing heading", good_readme, design,
             good_code + '// docs/design.md, "Zigzag\n// layout"\n', "", 1),
            ("a citation by number", good_readme, design, good_code + "// docs/design.md section 8.1\n", "", 1),
            ("a repeated heading in design.md", good_readme, design + "## Ring attention\n", good_code, "", 1),
        ]
        for name, readme, des, code, other, expected in cases:
            problems = tree(readme, des, code, other)
            if len(problems) != expected:
                failures.append(f"self-test, {name}: expected {expected} problem(s), got {len(problems)}: {problems}")
            else:
                print(f"self-test, {name}: {'passes' if expected == 0 else 'fails as it must: ' + problems[0]}")
    return failures


def main(argv):
    if argv[1:] == ["--self-test"]:
        failures = self_test()
    elif len(argv) >= 2 and set(argv[2:]) <= {"--forbid-numbered"}:
        failures = check(os.path.abspath(argv[1]), "--forbid-numbered" in argv[2:])
        if not failures:
            print(f"docs: every link of README.md and docs/*.md resolves, README.md is "
                  f"{os.path.getsize(os.path.join(argv[1], 'README.md'))} bytes (at most {README_LIMIT}), and every "
                  "design.md citation in the code names a heading")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for f in failures:
        print(f"error: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
