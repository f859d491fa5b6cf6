package main

import (
	"errors"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestUsage: -h and --help print the usage text to stdout and exit 0: what
// infermeshd is, how it is called, every flag of the command line (the
// list comes from its FlagSet, so a new flag cannot be left out) under its
// group's heading, in two-dash form, and examples.
func TestUsage(t *testing.T) {
	fs, _ := newFlags()
	inGroup := map[string]string{}
	for _, g := range flagGroups {
		for _, n := range g.names {
			if other, dup := inGroup[n]; dup {
				t.Errorf("flag %s is in groups %q and %q", n, other, g.title)
			}
			inGroup[n] = g.title
			if fs.Lookup(n) == nil {
				t.Errorf("group %q lists %s, which is not a flag", g.title, n)
			}
		}
	}
	fs.VisitAll(func(f *flag.Flag) {
		if inGroup[f.Name] == "" {
			t.Errorf("flag --%s is in no group of flagGroups: give it one", f.Name)
		}
	})

	for _, arg := range []string{"-h", "--help", "-help"} {
		cmd := exec.Command(bin, arg)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil || stderr.Len() > 0 {
			t.Fatalf("infermeshd %s: %v, stderr %q; want exit 0 and the usage on stdout", arg, err, stderr.String())
		}
		text := string(out)
		for _, want := range []string{"infermeshd is the infermesh agent", "\nUsage:\n  infermeshd [flags]\n", "\nExamples:\n", "\n  infermeshd --config /etc/infermesh/infermesh.yaml\n", "\n  -h, --help "} {
			if !strings.Contains(text, want) {
				t.Errorf("infermeshd %s: the usage lacks %q:\n%s", arg, want, text)
			}
		}
		// Each group's heading, in order, then its flags, one line each.
		section := map[string]string{}
		rest := text
		for _, g := range flagGroups {
			_, after, ok := strings.Cut(rest, "\n"+g.title+":\n")
			if !ok {
				t.Fatalf("infermeshd %s: no heading %q after the previous one:\n%s", arg, g.title, text)
			}
			body, _, _ := strings.Cut(after, "\n\n")
			section[g.title], rest = body, after
		}
		fs.VisitAll(func(f *flag.Flag) {
			body := section[inGroup[f.Name]]
			if !strings.Contains(body, "      --"+f.Name+" ") && !strings.HasSuffix(body, "      --"+f.Name) {
				t.Errorf("infermeshd %s: --%s is not listed under %q:\n%s", arg, f.Name, inGroup[f.Name], body)
			}
			if strings.Contains(text, " -"+f.Name+" ") {
				t.Errorf("infermeshd %s: -%s is shown with one dash", arg, f.Name)
			}
		})
		for _, line := range strings.Split(text, "\n") {
			if len(line) > usageWidth {
				t.Errorf("infermeshd %s: a line over %d columns: %q", arg, usageWidth, line)
			}
		}
	}
}

// TestFlagsTakeOneDashOrTwo: every spelling the usage promises works.
func TestFlagsTakeOneDashOrTwo(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "infermesh.yaml")
	if err := os.WriteFile(cfg, []byte("node: {name: a, state_dir: "+dir+"}\nroles:\n  chat: {port: 1, upstream: 'http://127.0.0.1:9'}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"-validate", "-config", cfg}, {"--validate", "--config", cfg},
		{"--validate", "--config=" + cfg}, {"-validate", "--config", cfg},
	} {
		out, err := exec.Command(bin, args...).CombinedOutput()
		if err != nil || !strings.Contains(string(out), cfg+": valid") {
			t.Errorf("infermeshd %v: %v, %q; want it valid", args, err, out)
		}
	}
	out, err := exec.Command(bin, "--bogus").CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != exitUsage || !strings.Contains(string(out), "infermeshd --help lists the flags") {
		t.Errorf("infermeshd --bogus: %v, %q; want exit %d pointing at --help", err, out, exitUsage)
	}
}
