# infermesh — build, run, test, benchmark.
GO        ?= go
BIN       := bin
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -s -w -X github.com/infermesh/infermesh/agent.Version=$(VERSION) -X main.version=$(VERSION)
TESTFLAGS ?=

.PHONY: all build run test test-short bench bench-quick bench-routing fuzz-quick lint clean node-image e2e demo-image install

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/...

## run: the agent in dev mode (one node, the built-in demo model as role chat on 127.0.0.1:18080)
run: build
	$(BIN)/infermeshd -dev

## demo-image: the demo model as a local image (DEMO_IMAGE, default infermesh-demo:local) for a managed
## instance without a registry: FROM scratch, the static binary, serving on 0.0.0.0:8080
DEMO_IMAGE ?= infermesh-demo:local
demo-image: build
	printf 'FROM scratch\nCOPY infermesh-demo /infermesh-demo\nEXPOSE 8080\nENTRYPOINT ["/infermesh-demo"]\nCMD ["-listen", "0.0.0.0:8080", "-model", "demo"]\n' \
		| docker build -q -t $(DEMO_IMAGE) -f - $(BIN)

## install: the binaries in $(PREFIX)/bin, the systemd unit, the user it runs as (sysusers.d), the
## sysctl drop-in, and the reference config unless one exists; then see docs/operations.md, "Installing on a host".
## DESTDIR stages the files elsewhere and leaves the user to the target (systemd-sysusers there)
PREFIX ?= /usr/local
install: build
	install -D -m 0755 $(BIN)/infermeshd $(DESTDIR)$(PREFIX)/bin/infermeshd
	install -D -m 0755 $(BIN)/infermesh $(DESTDIR)$(PREFIX)/bin/infermesh
	install -D -m 0644 configs/infermeshd.service $(DESTDIR)/etc/systemd/system/infermeshd.service
	install -D -m 0644 configs/infermesh.sysusers $(DESTDIR)/etc/sysusers.d/infermesh.conf
	install -D -m 0644 configs/60-infermesh-quic.conf $(DESTDIR)/etc/sysctl.d/60-infermesh-quic.conf
	[ -e $(DESTDIR)/etc/infermesh/infermesh.yaml ] || install -D -m 0640 configs/infermesh.yaml $(DESTDIR)/etc/infermesh/infermesh.yaml
# Installed in place: the user and group infermesh, the docker group where Docker is installed, and
# the config root's but readable by the agent's group (an existing one too: the unit ran as root once)
ifeq ($(DESTDIR),)
	systemd-sysusers /etc/sysusers.d/infermesh.conf
	if getent group docker >/dev/null; then usermod -aG docker infermesh; else echo "no docker group: once Docker is installed, usermod -aG docker infermesh"; fi
	chgrp infermesh /etc/infermesh/infermesh.yaml
endif

## node-image: the Debian bookworm systemd+sshd image docker nodes run (built once per recipe; see internal/nodeimage)
node-image:
	$(GO) run ./internal/nodeimage/cmd/node-image

## test: every test, with the race detector (the Docker tests included: they need a running engine)
test:
	$(GO) test -race -count=1 -timeout 25m $(TESTFLAGS) ./...
	# the proxy suite and the agent's abuse tests again against net/http's server and client (proxy.server: std)
	INFERMESH_PROXY_SERVER=std $(GO) test -race -count=1 -timeout 10m $(TESTFLAGS) ./proxy
	INFERMESH_PROXY_SERVER=std $(GO) test -race -count=1 -timeout 5m -run 'TestFDExhaustion|TestSIGTERMDuringAbuse' $(TESTFLAGS) ./cmd/infermeshd

## e2e: the cluster harness: N systemd hosts in containers (E2E_HOSTS, default 5) under faults, a table per fault (see e2e/)
e2e:
	$(GO) test -tags e2e -count=1 -timeout 30m -v -run TestClusterFaults ./e2e/

test-short:
	$(GO) test -count=1 -short ./...

## bench: the proxy against direct connection, nginx and haproxy, side by side, and the routing
## benchmark; everything the targets need in one run (23 minutes on a quiet 2-core host, 11 of them
## the 1000-node simulation, run last, and about 5 more for the routing benchmark);
## the report's header lists each phase's duration. BENCH_ARGS=-skip-mesh leaves the mesh out
bench: build
	bash bench/run.sh

## bench-quick: the same harness, shorter (CI keeps it working; asserts no speed)
bench-quick: build
	BENCH_QUICK=1 bash bench/run.sh

## bench-routing: the routing benchmark alone (a few minutes; BENCH_QUICK=1 about one)
bench-routing: build
	BENCH_ONLY=routing bash bench/run.sh

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

clean:
	rm -rf $(BIN) bench/results

## fuzz-quick: the differential fuzzers (against net/http) and the model rewriter, time-boxed for CI
FUZZTIME ?= 25s
fuzz-quick:
	$(GO) test -run '^$$' -fuzz '^FuzzH1RequestVsNetHTTP$$' -fuzztime $(FUZZTIME) -parallel 1 ./proxy
	$(GO) test -run '^$$' -fuzz '^FuzzResponseVsNetHTTP$$' -fuzztime $(FUZZTIME) -parallel 1 ./proxy
	$(GO) test -run '^$$' -fuzz '^FuzzRewriteModel$$' -fuzztime 15s -parallel 1 ./proxy
	$(GO) test -run '^$$' -fuzz '^FuzzBodyModel$$' -fuzztime 15s -parallel 1 ./proxy
	$(GO) test -run '^$$' -fuzz '^FuzzModelStream$$' -fuzztime 15s -parallel 1 ./proxy
