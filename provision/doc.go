// Package provision runs the model servers an infermesh agent manages on its
// own host. Bringing new hosts into the mesh is its subpackage node.
//
// # Words
//
// A node is a host in the mesh: one agent (infermeshd), one node key, one
// name (node.name). An instance is a model server an agent runs on its node
// for a role: a container or a process. Everything in this package is about
// instances unless its name says Node; the only node it knows today is its
// own, whose name scopes what it owns (DockerConfig.Node, the
// io.infermesh.node label) and is the execution target its resources are
// attributed to (the io.infermesh.target label, a workload record's
// target).
//
//   - attempt: one concrete incarnation of an instance (AttemptID >= 1). A
//     changed spec makes a new attempt; a restart does not.
//   - run: a group of attempts provisioned together (RunID). A role's
//     instance belongs to no run (0).
//   - runtime: how an instance runs: docker (a container), native (a
//     process on the host) or simulated (the built-in demo model, served
//     inside the agent: nothing here provisions it).
//   - provider: what acquires and releases the resources of instances for a
//     runtime (Provider; DockerProvider, NativeProvider).
//   - resource: what a provider holds for an attempt: a container or a
//     process. Its ref is its stable provider-side address (the name derived
//     from the spec); its resource id is the engine's id, or the pid.
//   - workload record: a native instance's ownership evidence
//     (WorkloadRecord), in its node folder under the site root.
//   - intent: an attempt's ProvisionSpec, written to the IntentStore before
//     its resource is created and deleted after the resource is gone.
//   - observation: what a provider saw of a running instance (output lines,
//     the end of a run); event: a lifecycle milestone for operators and the
//     audit trail ("provision.<kind>" in `infermesh events`).
//
// # What it owns, and what not
//
// It owns the instance provider contract, the Docker and native providers,
// the instance Manager (create or adopt, probe, register in placement,
// restart within a policy), the intent store's bucket, and the runtimes'
// side of site cleanup (SiteCleanups: the cleanup.Backends of Docker and
// native resources). It does not own the placement table (package
// placement), the configuration (agent), serving requests (proxy), or the
// rules and order of site cleanup (cleanup, seed 004): the agent's orphan
// sweep is a cleanup.Sweeper over SiteCleanups, keeping what
// Manager.Wanted returns.
//
// # Layers
//
// The layers, each usable on its own:
//
//   - The provider contract (Provider, ProvisionSpec, Observation, Event): how
//     a runtime acquires, adopts and releases one concrete instance attempt.
//     The rules carried over from the reference design: attempt id 0 is
//     reserved for an unbound template; a selected offer is authoritative
//     (never substituted); PrepareBySpec never creates a resource; the
//     provider ref of a spec is derivable without provider state; StopBySpec
//     of something already gone is success (false, nil).
//   - DockerProvider: the contract over a Docker engine. Containers get a
//     deterministic name and io.infermesh.* ownership labels, publish their
//     port on 127.0.0.1 only, and are only ever removed after their labels
//     were re-checked client-side (fail closed).
//   - NativeProvider: the contract over processes on this host. A process
//     leads its own session and process group (it outlives the agent and
//     is stopped as a group), writes its output to log files the agent
//     follows, and is known by its workload record: pid, start time,
//     executable, boot and a token in its environment, written before it
//     starts and checked before it is adopted or stopped. A pid alone is
//     never trusted.
//   - Manager: turns the roles' desired instances (InstanceSpec) into
//     running, probed, supervised containers or processes registered in
//     placement, through one InstanceProvider per runtime. Intent is written
//     to the IntentStore before any resource is created, so an agent crash
//     at any point leaves something to adopt or to clean up.
//
// # Glossary: seed 000, the provision plugin contract
//
// The reference design calls an instance a node, and its start a bootstrap.
// In infermesh a bootstrap is only ever the SSH session that brings a node
// into the mesh (seed 001, below).
//
//	seed 000                      infermesh
//	NodeProvisionSpec             ProvisionSpec: one instance attempt
//	  run_id, attempt_id          RunID, AttemptID (0: unbound template, refused)
//	  node_id                     InstanceID, stored as "instance_id";
//	                              "node_id" is still read
//	  stage_index                 dropped: an instance serves a role, not a
//	                              stage of a run; intents with it still decode
//	  image, env, args, mounts    Image, Env ([]EnvVar), Args, Mounts
//	  (none)                      Role, Ports: what a role's instance adds
//	ProviderMount                 Mount
//	ProvisionEvent, its kind      Event, EventKind
//	  ProvisionStart              EventProvisionStart
//	  NodeLive                    EventInstanceLive
//	  ProvisionFailed             EventProvisionFailed
//	  NodeStopped                 EventInstanceStopped
//	PluginObservation             Observation, ObservationKind
//	  StdoutLine, StderrLine      ObsStdout, ObsStderr
//	  TelemetryFrame              ObsTelemetry (none from Docker: DockerProvider)
//	  ProviderLine                ObsProvider
//	  Exited{status}              ObsExited (Status; nil for a native
//	                              process this agent did not start)
//	  Failed{reason}              ObsFailed (Reason): killed out of memory,
//	                              container vanished, process killed by a
//	                              signal
//	ProvisionLogLine, LogStream   LogLine in the instance's LogRing
//	PluginObservationSink         Sink
//	PluginSink                    Sink, SinkFunc
//	PluginNodeHandle              InstanceHandle
//	AdoptedNode                   AdoptedInstance
//	ProvisionPlugin               Provider: the calls the Manager makes;
//	                              defaults in ProviderDefaults; what only
//	                              some providers do is a small interface
//	  create_node                 Provider.CreateInstance
//	  create_node_selected        CreateSelected: OfferSelector's
//	                              CreateInstanceSelected, or the default
//	                              (a nil offer creates, any other is
//	                              ErrOfferUnsupported, never substituted)
//	  start_bootstrap             Provider.StartInstance
//	  cancel_bootstrap            Provider.HaltInstance
//	  complete_bootstrap          Provider.MarkLive
//	  stop_node                   InstanceStopper.StopInstance
//	  adopt_by_spec               Provider.AdoptBySpec
//	  prepare_missing_bootstrap   Provider.PrepareBySpec
//	  provider_ref_for            Provider.ProviderRef
//	  list_managed_refs           ManagedRefs: RefLister's ListManagedRefs,
//	                              or nothing; the agent's orphan sweep goes
//	                              through SiteCleanups instead
//	  stop_by_spec                Provider.StopBySpec
//	(none)                        ImageEnsurer.EnsureImage: fetch a missing
//	                              image first (DockerProvider)
//
// # Glossary: seed 001, node provisioning
//
// Seed 001 brings hosts into the mesh: a host is leased, bootstrapped over
// SSH, and observed to join. It lives in the subpackage node
// (provision/node), which shares this package's Docker client and
// ownership labels; its package doc has the full glossary:
//
//	seed 001                      infermesh (package node)
//	LogicalNodeId                 Spec.Name, the new node's name (node.name)
//	swactor                       the agent, infermeshd
//	SwactorId                     the name the node joined as, admitted with
//	                              the key made on it
//	SwarmJoinSpec                 Spec.Join, Spec.JoinCredentialRef
//	ProviderPlugin, ProviderKind  Lease, Kind: DockerLease (a node container
//	                              running systemd and sshd) or SSHLease (an
//	                              existing host)
//	  create/destroy_lease        Lease.Create, Lease.Destroy
//	  lookup_endpoint             Lease.LookupEndpoint
//	LeaseFacts, DestroyHandle     LeaseFacts, DestroyHandle: kept in the
//	                              node's Record (its intent)
//	DockerCli                     DockerAPI, met by DockerClient
//	SshBootstrapSession           Session over a Client (SSHClient: x/crypto/ssh)
//	  BootstrapStage              Stage, with the seed's messages
//	  BootstrapLogRecord          LogRecord: one sequence for stdout and stderr
//	NodeManager                   Machine: messages in, commands out
//	DockerNodeProvisioner         Provisioner (any Lease), Close for Drop
package provision
