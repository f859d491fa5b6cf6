package provision

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/infermesh/infermesh/cleanup"
	"github.com/infermesh/infermesh/identity"
)

// NativeRuntimeName is the native runtime's name in cleanup reports.
const NativeRuntimeName = "native runtime"

// The native runtime's part of a site cleanup, and the cleanup of the
// workloads located in a directory about to be deleted. Native workloads
// are found by their records (WorkloadRecord), and every record is checked
// against the live system before anything stops: a record that names
// another site or node than where it lies, that cannot be read, or whose
// process is not the recorded one (its pid reused, its executable or token
// not the recorded ones) refuses the whole operation (cleanup.ErrRefused),
// naming why. A recorded process that is gone needs no stopping: its record
// and logs are removed.

// nativeFinder classifies the workload records under a directory.
type nativeFinder struct {
	root   string
	isNode bool   // root is a node folder, not a site root
	site   string // every record must name it
	node   string // every record must name it ("" : any node, but always its folder's)
}

// classify reads and checks every record in scope. Records of another
// well-formed target are left out; anything that cannot be attributed or
// trusted fails the whole pass.
func (f nativeFinder) classify(scope cleanup.Scope) ([]cleanup.Resource, error) {
	recs, err := findRecords(f.root, f.isNode)
	if err != nil {
		return nil, fmt.Errorf("workload records under %s: %w", f.root, err)
	}
	var (
		out      []cleanup.Resource
		refusals []string
		unattrib []string
	)
	for _, lr := range recs {
		rec := lr.Rec
		switch {
		case lr.Err != nil:
			refusals = append(refusals, fmt.Sprintf("%s: unreadable: %v", lr.Path, lr.Err))
			continue
		case rec.Site != f.site:
			refusals = append(refusals, fmt.Sprintf("%s: names site %q, not %q", lr.Path, rec.Site, f.site))
			continue
		case rec.Node != lr.Folder || (f.node != "" && rec.Node != f.node):
			refusals = append(refusals, fmt.Sprintf("%s: names node %q but lies in node folder %q", lr.Path, rec.Node, lr.Folder))
			continue
		}
		terr := identity.ValidateNodeName(rec.Target)
		if terr != nil && !scope.IsSite() {
			unattrib = append(unattrib, fmt.Sprintf("%s: execution target: %v", lr.Path, terr))
			continue
		}
		if terr == nil && !scope.Includes(rec.Target) {
			continue
		}
		ev, err := rec.Check()
		if err != nil {
			refusals = append(refusals, fmt.Sprintf("%s: evidence cannot be read: %v", lr.Path, err))
			continue
		}
		if ev.Liveness == Forged || ev.Liveness == Reused {
			refusals = append(refusals, fmt.Sprintf("%s: %s", lr.Path, ev.Why))
			continue
		}
		out = append(out, describeNative(lr.Path, rec, ev))
	}
	if len(refusals) > 0 {
		return nil, fmt.Errorf("%w: %s", cleanup.ErrRefused, strings.Join(refusals, "; "))
	}
	if len(unattrib) > 0 {
		return nil, fmt.Errorf("%w: %s", cleanup.ErrUnattributable, strings.Join(unattrib, "; "))
	}
	return out, nil
}

func describeNative(path string, rec WorkloadRecord, ev Evidence) cleanup.Resource {
	r := cleanup.Resource{
		Runtime: NativeRuntimeName, Ref: rec.Ref, Role: rec.Role, Target: rec.Target,
		Attempt: rec.Attempt, Created: rec.Created, Location: path,
	}
	var b strings.Builder
	if ev.Liveness == Alive {
		r.ID, r.State = strconv.Itoa(ev.Pid), "running"
		fmt.Fprintf(&b, "process %d %s (%s", ev.Pid, rec.Command, rec.Ref)
	} else {
		r.State = rec.State
		if rec.State == WorkloadRunning {
			r.State = "exited"
		}
		fmt.Fprintf(&b, "record of %s %s (", rec.Command, rec.Ref)
		b.WriteString("no process")
		if ev.Why != "" {
			fmt.Fprintf(&b, ": %s", ev.Why)
		}
	}
	if rec.Role != "" {
		fmt.Fprintf(&b, ", role %s", rec.Role)
	}
	fmt.Fprintf(&b, ", node %s, attempt %d, %s)", rec.Target, rec.Attempt, r.State)
	r.Description = b.String()
	return r
}

// removeClassified re-reads r's record just before removing it, refuses
// unless it still names the same workload with evidence that holds, stops
// its process group, then removes the record and logs. Gone is success.
func removeClassified(ctx context.Context, r cleanup.Resource, site string, scope cleanup.Scope, stopTimeout time.Duration) error {
	rec, err := readRecord(r.Location)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("%w: %v", cleanup.ErrRefused, err)
	}
	if rec.Site != site || rec.Ref != r.Ref || rec.Target != r.Target || (!scope.IsSite() && !scope.Includes(rec.Target)) {
		return fmt.Errorf("%w: record %s changed since it was classified", cleanup.ErrRefused, r.Location)
	}
	ev, err := rec.Check()
	if err != nil {
		return fmt.Errorf("%w: %s: evidence cannot be read: %v", cleanup.ErrRefused, r.Location, err)
	}
	switch ev.Liveness {
	case Forged, Reused:
		return fmt.Errorf("%w: %s: %s", cleanup.ErrRefused, r.Location, ev.Why)
	case Alive:
		if r.ID != strconv.Itoa(ev.Pid) {
			return fmt.Errorf("%w: record %s names pid %d, classified as %q", cleanup.ErrRefused, r.Location, ev.Pid, r.ID)
		}
		fd, err := openPidfd(ev.Pid, ev.StartTime)
		if err == nil {
			err = stopGroup(ctx, fd, stopTimeout)
			fd.close()
		}
		if err != nil && !errors.Is(err, errNoProcess) {
			return fmt.Errorf("stop pid %d: %w", ev.Pid, err)
		}
	}
	nodeDir := filepath.Dir(filepath.Dir(r.Location))
	return errors.Join(removeRecord(r.Location), removeLogs(nodeDir, rec.Ref))
}

// NativeSiteCleanup is the native runtime's part of a site cleanup
// (cleanup.Runtime): the workloads recorded under the site root, in every
// node folder. Its control plane is this host's file system and /proc: it
// is never unreachable.
type NativeSiteCleanup struct {
	siteRoot    string
	stopTimeout time.Duration
}

var _ cleanup.Runtime = (*NativeSiteCleanup)(nil)

// NewNativeSiteCleanup returns the native runtime's cleanup of the site
// root. A zero stopTimeout means DefaultNativeConfig's.
func NewNativeSiteCleanup(siteRoot string, stopTimeout time.Duration) *NativeSiteCleanup {
	if stopTimeout <= 0 {
		stopTimeout = DefaultNativeConfig().StopTimeout
	}
	return &NativeSiteCleanup{siteRoot: siteRoot, stopTimeout: stopTimeout}
}

// Name implements cleanup.Runtime.
func (n *NativeSiteCleanup) Name() string { return NativeRuntimeName }

// Discover implements cleanup.Runtime.
func (n *NativeSiteCleanup) Discover(ctx context.Context, site string, scope cleanup.Scope) ([]cleanup.Resource, error) {
	return nativeFinder{root: n.siteRoot, site: site}.classify(scope)
}

// Remove implements cleanup.Runtime.
func (n *NativeSiteCleanup) Remove(ctx context.Context, site string, scope cleanup.Scope, r cleanup.Resource) error {
	if r.Location == "" || !strings.HasPrefix(r.Location, n.siteRoot+string(filepath.Separator)) {
		return fmt.Errorf("%w: %s is not a record under %s", cleanup.ErrRefused, r.Location, n.siteRoot)
	}
	return removeClassified(ctx, r, site, scope, n.stopTimeout)
}

// nativeLocated is the cleanup of the native workloads recorded under one
// directory about to be deleted (cleanup.LocatedWorkloads).
type nativeLocated struct {
	find        nativeFinder
	stopTimeout time.Duration
}

var _ cleanup.LocatedWorkloads = (*nativeLocated)(nil)

func (l *nativeLocated) RuntimeName() string { return NativeRuntimeName }

// Inventory implements cleanup.LocatedWorkloads.
func (l *nativeLocated) Inventory(ctx context.Context) ([]cleanup.Resource, error) {
	return l.find.classify(cleanup.SiteScope())
}

// Cleanup implements cleanup.LocatedWorkloads: every record is classified
// (its evidence checked) before any process stops.
func (l *nativeLocated) Cleanup(ctx context.Context) ([]cleanup.Resource, error) {
	cs, err := l.find.classify(cleanup.SiteScope())
	if err != nil {
		return nil, err
	}
	var (
		removed []cleanup.Resource
		errs    []error
	)
	for _, r := range cs {
		if err := removeClassified(ctx, r, l.find.site, cleanup.SiteScope(), l.stopTimeout); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", r.Ref, err))
			continue
		}
		removed = append(removed, r)
	}
	return removed, errors.Join(errs...)
}
