// Package e2e is the cluster harness: real systemd hosts in containers,
// each running infermeshd from configs/infermeshd.service unchanged, with
// the real config layout (/etc/infermesh, /var/lib/infermesh) and static
// binaries, on a Docker network of their own. Its test (build tag e2e,
// `make e2e`) puts the mesh under the faults a fleet sees, injected from
// the Docker host only, while a load generator on one host (cmd/e2eload)
// sends requests and streams through the agent's loopback proxy, and
// prints a table per fault: requests sent, failed, stalled, streams cut
// with a clear abort or (never acceptable) passed off as complete, and the
// time to recover.
//
// Hosts: h0 is the application host (role chat, served only by peers);
// h1..h(N-1) serve chat from a native demo model instance. Everything
// created is named infermesh-e2e-faults-<run> and labelled
// io.infermesh.e2e=<run>, and removed at the end, on failure and on
// interrupt alike.
package e2e
