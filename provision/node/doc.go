// Package node brings a host into the mesh: it leases the host (a docker
// node container on this machine, or an existing server reached over SSH),
// runs a bootstrap session on it over SSH (the agent binary uploaded and
// checked, the node key made on the host, an admission certificate issued,
// the unit started), observes the join in this agent's mesh view, and
// tears everything down on any failure.
//
// In this package a *node* is a host running (or about to run) infermeshd;
// the model servers on a node are its instances (package provision).
//
// # Layers
//
//   - Lease (lease.go): the provider boundary. DockerLease creates node
//     containers from the node image (internal/nodeimage) with a host key
//     generated before start; SSHLease is an existing host, whose Destroy
//     undoes only what the bootstrap recorded it installed.
//   - Session (session.go): one bootstrap over a Client (the SSH boundary;
//     SSHClient is the real one over golang.org/x/crypto/ssh), stage by
//     stage, each output line a LogRecord with one sequence number shared by
//     stdout and stderr.
//   - Machine (machine.go): the pure state machine. Messages in, commands
//     out; no I/O.
//   - Provisioner (provisioner.go): runs the Machine's commands against a
//     Lease and a Session, last in first out, feeding every result back as
//     a message; tears down on any failure.
//   - Manager (manager.go): the agent's side: writes each node's intent to
//     the state store before its lease is created, streams progress, waits
//     for convergence, removes nodes, and at start tears down what a crash
//     left half done.
//
// # Glossary (reference design -> infermesh)
//
//	logical node id          Spec.Name (the node's mesh name)
//	run id                   Spec.Run (one per add attempt)
//	provider plugin          Lease
//	lease facts              LeaseFacts (the resource a Lease holds)
//	swactor                  infermeshd, the agent
//	swarm join spec          Spec.Join and Spec.JoinCredentialRef
//	swactor joined           the node is admitted in this agent's memberlist
//	                         view with the key made on the host, and its
//	                         adverts arrived
//	NodeManager              Machine
//	DockerNodeProvisioner    Provisioner (for any Lease, not only docker)
//	BootstrapSshClient       Client
//	datastream sink          Sink
//	Drop                     Provisioner.Close
package node
