#!/usr/bin/env python3
"""Removes one check of kv::TransferReceiver at a time, rebuilds the kvtransfer tests, runs the
in-process receiver tests and prints which fail (each check must be caught by at least one).
Restores the source afterwards, also on failure.

Usage: tools/kvtransfer_receiver_mutations.py BUILD_DIR [INDEX ...]
  BUILD_DIR: a configured build directory (use a separate one: it is rebuilt per mutation).
  INDEX: only these mutations (0-based). FILTER (env): a gtest filter instead of the default.
"""
import json, os, re, subprocess, sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, 'kvtransfer/transfer_receiver.cc')
BUILD = os.path.abspath(sys.argv[1])
M = [
 ("expect: descriptor/destination count", "if (spec.pages.size() != spec.destinations.size()) {", "if (false) {"),
 ("expect: descriptor/destination size", "if (spec.pages[slot].bytes != spec.destinations[slot].size()) {", "if (false) {"),
 ("expect: one receiving ticket per request", "if (entry->ticket.request_id == spec.request_id && entry->state == TransferState::kReceiving) {", "if (false) {"),
 ("page: epoch", "if (header.epoch != ticket.epoch) {", "if (false) {"),
 ("page: slot within the ticket", "if (header.slot >= ticket.pages.size()) {", "if (false) {"),
 ("page: descriptor (layer, index, tokens, bytes)", "page.layer != header.layer || page.page_index != header.page_index ||\n      page.token_begin != header.token_begin || page.token_end != header.token_end ||\n      !wire.ok() || *wire != length) {", "false) {"),
 ("page: duplicate slot", "if (entry.slots[header.slot] != Entry::Slot::kEmpty) {", "if (false) {"),
 ("page: ticket belongs to another request", "if (entry.ticket.request_id != header.request_id) {", "if (false) {"),
 ("page: released ticket -> stray, not the retry's error", "if (header.ticket_id < next_ticket_id_) {", "if (false) {"),
 ("page: unknown ticket fails the request's receiving ticket", "if (entry->ticket.request_id == header.request_id &&\n        entry->state == TransferState::kReceiving) {", "if (false) {"),
 ("page: refused once the ticket left kReceiving", "if (entry == nullptr || entry->state != TransferState::kReceiving) {", "if (entry == nullptr) {"),
 ("landing: failed landing leaves the slot empty", "  if (!status.ok()) {\n    // The sender vanished", "  (void)status;\n  if (false) {\n    // The sender vanished"),
 ("landing: xxh3 of the payload", "if (actual != entry.header_checksums[slot]) {", "if (false) {"),
 ("page: size in the sent element type", "!wire.ok() || *wire != length) {", "!wire.ok()) {"),
 ("landing: another element type lands in a conversion buffer", "  if (header.element != entry->ticket.pages[header.slot].element) {", "  if (false) {"),
 ("landing: converted only after the checksum passed", "if (convert && actual == entry.header_checksums[slot]) {", "if (convert) {"),
 ("control: stray (ticket/request mismatch)", "if (found == entries_.end() || found->second->ticket.request_id != message.request_id) {", "if (found == entries_.end()) {"),
 ("control: commit of the ticket's epoch lifts the abort fence", "    // that no write is in flight. Pages it sent after the abort were refused, never landed.\n    entry.fence = true;", "    // that no write is in flight. Pages it sent after the abort were refused, never landed.\n"),
 ("control: only a commit of the ticket's epoch lifts it", "if (entry.state == TransferState::kAborted && message.kind == WireKind::kCommit &&\n      message.epoch == entry.ticket.epoch) {", "if (entry.state == TransferState::kAborted && message.kind == WireKind::kCommit) {"),
 ("control: epoch of commit/heartbeat", "if (message.epoch != entry.ticket.epoch) {\n    FailEntry", "if (false) {\n    FailEntry"),
 ("control: heartbeat renews the lease", "    entry.ticket.lease_deadline =\n        std::max(entry.ticket.lease_deadline, clock_.Now() + options_.lease);\n", ""),
 ("commit: pages_sent equals the ticket's pages", "if (commit.pages_sent != ticket.pages.size()) {", "if (false) {"),
 ("commit: wait for every page (grace)", "if (entry.landed != ticket.pages.size()) return;", "if (false) return;"),
 ("commit: per-layer digests", "if (!digests_match) {", "if (false) {"),
 ("sweep: lease expiry", "if (now > ticket.lease_deadline) {", "if (false) {"),
 ("sweep: missing-page check after the commit", "} else if (entry.commit.has_value() && now > entry.commit_at + options_.missing_grace) {", "} else if (false) {"),
 ("sweep: the missing-page grace itself", "now > entry.commit_at + options_.missing_grace) {", "now >= entry.commit_at) {"),
 ("release: nothing while a landing is in flight", "if (entry.landings_in_flight == 0) {\n      switch", "if (true) {\n      switch"),
 ("release: failed pages quarantined until the lease", "        case TransferState::kFailed:\n          release = now >= ticket.lease_deadline;", "        case TransferState::kFailed:\n          release = true;"),
 ("release: aborted pages wait for the fence or the lease", "release = entry.fence || now >= ticket.lease_deadline;", "release = true;"),
 ("release: aborted pages released by the fence", "release = entry.fence || now >= ticket.lease_deadline;", "release = now >= ticket.lease_deadline;"),
 ("abort: a commit in hand counts as the fence", "if (entry.commit.has_value()) entry.fence = true;\n    Decide", "Decide"),
 ("abort: refused once verified", "  if (entry.state == TransferState::kVerified) {\n    return absl::FailedPreconditionError(", "  if (false) {\n    return absl::FailedPreconditionError("),
 ("fence: abandons a receiving ticket", "  if (entry.state != TransferState::kReceiving || entry.commit.has_value()) return;\n  ++stats_.abandoned;", "  return;\n  ++stats_.abandoned;"),
 ("fence: not after a commit (missing-page check decides)", "if (entry.state != TransferState::kReceiving || entry.commit.has_value()) return;", "if (entry.state != TransferState::kReceiving) return;"),
 ("outcome: pushed to on_outcome", "  on_outcome_(entry.ticket.ticket_id", "  if (false) on_outcome_(entry.ticket.ticket_id"),
 ("outcome: verified kept until read", "forget = now >= ticket.lease_deadline &&\n                   (entry.outcome_read || now >= ticket.lease_deadline + options_.lease);", "forget = now >= ticket.lease_deadline;"),
 ("outcome: verified forgotten once read after the lease", "forget = now >= ticket.lease_deadline &&\n                   (entry.outcome_read || now >= ticket.lease_deadline + options_.lease);", "forget = false;"),
]
only = set(int(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else None
orig = open(SRC).read()
results = []
try:
  for i, (name, old, new) in enumerate(M):
    if only is not None and i not in only: continue
    n = orig.count(old)
    if n != 1:
      results.append((i, name, 'PATTERN %d' % n, [])); print(i, name, 'PATTERN', n, flush=True); continue
    open(SRC, 'w').write(orig.replace(old, new))
    b = subprocess.run(['cmake', '--build', BUILD, '-j2', '--target', 'pdserve_kvtransfer_tests'], capture_output=True, text=True)
    if b.returncode != 0:
      results.append((i, name, 'BUILD FAILED', [])); print(i, name, 'BUILD FAILED', b.stdout[-2000:], flush=True); continue
    try:
      r = subprocess.run([os.path.join(BUILD, 'tests/kvtransfer/pdserve_kvtransfer_tests'), '--gtest_filter=' + os.environ.get('FILTER', 'Loopback*:InProcessTest.ExpectRejects*')], capture_output=True, text=True, timeout=120, env={'PDSERVE_TEST_SEED': '7', 'UCX_TLS': 'tcp', 'PATH': '/usr/bin:/bin'})
      out = r.stdout + r.stderr
      failed = sorted(set(re.findall(r'\[  FAILED  \] (\S+\.\S+)', out)))
      status = 'rc=%d' % r.returncode
      if r.returncode != 0 and not failed:
        m = re.findall(r'\[ RUN      \] (\S+)', out)
        failed = ['CRASH in ' + (m[-1] if m else '?')]
    except subprocess.TimeoutExpired:
      failed = ['TIMEOUT']; status = 'timeout'
    results.append((i, name, status, failed)); print(i, name, status, failed, flush=True)
finally:
  open(SRC, 'w').write(orig)
print(json.dumps(results, indent=1))
