package main

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

// The markdown of the repository: every relative link in it must reach a
// file or directory of the tree, and a #fragment a heading of the target
// (GitHub's anchors). A link into a section that moved fails here.

var (
	mdLink     = regexp.MustCompile(`\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	mdCodeSpan = regexp.MustCompile("`+[^`]*`+")
	mdHeading  = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*#*\s*$`)
	mdTextLink = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`)
)

// markdownLines returns the lines of a markdown text outside fenced blocks.
func markdownLines(text string) []string {
	var lines []string
	fenced := false
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			continue
		}
		if !fenced {
			lines = append(lines, line)
		}
	}
	return lines
}

// githubAnchor is the anchor GitHub gives a heading's text: lower case,
// every character but letters, digits, spaces, '-' and '_' dropped, each
// space a '-'.
func githubAnchor(heading string) string {
	heading = mdTextLink.ReplaceAllString(heading, "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// markdownAnchors returns the anchors of a markdown text's headings, a
// repeated one numbered as GitHub numbers it (x, x-1, x-2...).
func markdownAnchors(text string) map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	for _, line := range markdownLines(text) {
		m := mdHeading.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		a := githubAnchor(m[1])
		if n := seen[a]; n > 0 {
			anchors[a+"-"+strconv.Itoa(n)] = true
		} else {
			anchors[a] = true
		}
		seen[a]++
	}
	return anchors
}

// brokenLinks returns a description of every relative link of the
// markdown file at path (inside root) that does not resolve.
func brokenLinks(root, path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	rel, _ := filepath.Rel(root, path)
	var broken []string
	for _, line := range markdownLines(string(b)) {
		for _, m := range mdLink.FindAllStringSubmatch(mdCodeSpan.ReplaceAllString(line, ""), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			dest := path
			if file != "" {
				dest = filepath.Join(filepath.Dir(path), file)
			}
			if r, err := filepath.Rel(root, dest); err != nil || strings.HasPrefix(r, "..") {
				broken = append(broken, rel+": "+target+": outside the repository")
				continue
			}
			info, err := os.Stat(dest)
			if err != nil {
				broken = append(broken, rel+": "+target+": no such file")
				continue
			}
			if anchor == "" {
				continue
			}
			if info.IsDir() || !strings.HasSuffix(dest, ".md") {
				broken = append(broken, rel+": "+target+": an anchor into a file that is not markdown")
				continue
			}
			text, err := os.ReadFile(dest)
			if err != nil {
				return nil, err
			}
			if !markdownAnchors(string(text))[anchor] {
				broken = append(broken, rel+": "+target+": no heading has the anchor #"+anchor)
			}
		}
	}
	return broken, nil
}

// TestMarkdownLinksResolve checks every markdown file of the repository
// (README.md, CHANGELOG.md, docs/, the commands' READMEs...): what must
// hold is that each relative link names a file of the tree and each
// #anchor a heading of its target.
func TestMarkdownLinksResolve(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	var files []string
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			rel, _ := filepath.Rel(root, path)
			switch {
			case rel != "." && strings.HasPrefix(d.Name(), "."),
				d.Name() == "testdata", rel == "bin", rel == "dist", rel == "tmp", rel == filepath.Join("bench", "results"):
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(path, ".md") {
			files = append(files, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"README.md", "CHANGELOG.md", filepath.Join("docs", "README.md")} {
		if _, err := os.Stat(filepath.Join(root, want)); err != nil {
			t.Errorf("the repository lacks %s: %v", want, err)
		}
	}
	for _, f := range files {
		broken, err := brokenLinks(root, f)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range broken {
			t.Error(b)
		}
	}
	if len(files) < 9 {
		t.Errorf("found %d markdown files, want README.md, CHANGELOG.md, docs/ and more", len(files))
	}
}

// TestGithubAnchor pins the anchor rule on headings of this repository's
// kind: code spans, punctuation, a comma, a repeated heading.
func TestGithubAnchor(t *testing.T) {
	for heading, want := range map[string]string{
		"A managed instance, end to end":     "a-managed-instance-end-to-end",
		"Set-up: two commands":               "set-up-two-commands",
		"`infermesh node add`":               "infermesh-node-add",
		"The [CLI](cmd/infermesh/README.md)": "the-cli",
		"What changed in this round":         "what-changed-in-this-round",
		"proxy.max_conns and `EMFILE`":       "proxymax_conns-and-emfile",
	} {
		if got := githubAnchor(heading); got != want {
			t.Errorf("githubAnchor(%q) = %q, want %q", heading, got, want)
		}
	}
	got := markdownAnchors("# A\n\n## A\n\n```\n# not a heading\n```\n## A\n")
	for _, want := range []string{"a", "a-1", "a-2"} {
		if !got[want] {
			t.Errorf("markdownAnchors lacks %q: %v", want, got)
		}
	}
	if got["not-a-heading"] {
		t.Errorf("a line in a fenced block was taken for a heading")
	}
}
