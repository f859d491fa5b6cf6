// Package cleanup lists and removes the runtime resources a site owns on
// this host: the contracts and the orchestration of site inventory, site
// cleanup, site reset, site deletion and a node leaving its site, and the
// agent's own orphan sweep, which is the same code.
//
// # What it owns, and what not
//
// It owns the words (binding kinds, scopes, resources, skipped runtimes),
// the rules every runtime's cleanup follows, the order of a stopped-site
// operation (Site), the state store's lock that proves the site is stopped
// (StoreLock), where a site keeps things on a host (Layout), the lenient
// reading of a configuration for an operation on a stopped site
// (ReadSiteConfig) and the periodic orphan sweep (Sweeper). It names no
// runtime: the runtimes' cleanups are supplied through Backends by package
// provision, which knows Docker labels and native workload records.
//
// # Rules
//
//   - Selection: the cleanups are selected from the binding kinds the
//     site's configuration uses, without contacting any runtime
//     (Backends.SiteCleanup). A configuration that cannot be read selects
//     every kind, each bound (SelectKinds). A runtime key this version does
//     not know fails with *UnknownBindingError before any connection.
//   - Bound and optional: a runtime is bound when the configuration binds
//     it; unreachable, it fails the operation (fail closed). Otherwise it is
//     optional: unreachable, it is skipped, and the inventory or report
//     says so with the reason (Skipped).
//   - Scopes: SiteScope is every resource labelled with the site on this
//     host, whichever node created it. TargetScope names execution targets
//     (nodes): only the site's resources attributed to one of them; other
//     well-formed targets' are left alone; a site resource whose target is
//     missing or malformed fails the whole operation (ErrUnattributable)
//     and nothing is removed.
//   - Inventory is read-only and lists resources grouped by runtime, in
//     discovery order, each with an operator-facing description.
//   - Cleanup ensures absence: already absent is success, so running it
//     twice is safe. Everything is classified before anything is removed,
//     and each resource's labels or record are checked again just before it
//     is removed (ErrRefused when they changed).
//   - Located workloads (native processes, found by their records under a
//     directory about to be deleted) have their ownership evidence checked
//     before anything stops; evidence that does not hold refuses the
//     removal and names why (ErrRefused).
//   - Root-owned site data under the site root is removed by a runtime that
//     can act as root (Backends.RemoveRootOwnedSiteData) when the host
//     could not remove it. Node-local workload caches live outside the site
//     root (Layout.SiteCache); another site's are never touched, and an
//     absent cache counts as removed.
//   - Stopped sites only: every removing operation needs the state store's
//     exclusive lock (LockStore), which a running agent holds: the CLI
//     refuses while the agent runs, and the agent cannot start meanwhile.
//   - The agent's orphan sweep (Sweeper) is a cleanup of scope targets
//     <its node> that keeps what the agent still wants and what is younger
//     than a grace period (it may be being created). It runs periodically,
//     and until one sweep has succeeded it retries with backoff.
//
// # Glossary: seed 004, site runtime inventory and cleanup
//
//	seed 004                          infermesh
//	RuntimeBindingKind                Kind: Docker, Native, Simulated
//	  ALL                             AllKinds
//	SiteRuntimeCleanups               Backends (provision.SiteCleanups)
//	  site_cleanup                    Backends.SiteCleanup
//	  located_workloads               Backends.LocatedWorkloads
//	  remove_root_owned_site_data     Backends.RemoveRootOwnedSiteData
//	  remove_workload_caches          Backends.RemoveWorkloadCaches (and
//	                                  one node's, for a leave)
//	(none)                            Backends.ForgetIntents: the durable
//	                                  intents in the state store
//	SiteRuntimeCleanup                SiteCleanup, over one Runtime per
//	                                  runtime (Part: the runtime, bound or
//	                                  not)
//	  inventory, cleanup              SiteCleanup.Inventory, .Cleanup, and
//	                                  .Sweep for the agent's orphans
//	LocatedWorkloadCleanup            LocatedWorkloads
//	SiteRuntimeScope                  Scope
//	  Site                            SiteScope
//	  ExecutionTargets                TargetScope; an execution target is a
//	                                  node (the io.infermesh.target label, a
//	                                  workload record's target)
//	SiteRuntimeInventory              Inventory
//	SiteRuntimeResource               Resource (with its identity as fields)
//	SiteRuntimeCleanupReport          Report (with what was removed)
//	SkippedSiteRuntimeCleanup         Skipped
//	SiteRuntimeResetConfigurationError
//	  UnknownBinding                  *UnknownBindingError
//	SiteNodeId                        a node name
//	site reset, deletion, node leave  Site.Reset, Site.Delete, Site.Leave
//	an exclusively locked stopped     StoreLock: the state store's lock
//	site
package cleanup
