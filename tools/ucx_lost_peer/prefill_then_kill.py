"""Reserve on a decode worker, Prefill on a prefill worker, SIGKILL the decode worker while the
pages are in flight; prints the Prefill's status. Speaks gRPC through server reflection, so it
needs no generated code (grpcio, grpcio-reflection: the test venv /var/lib/pdserve/venv).

Usage: prefill_then_kill.py PREFILL_ADDR DECODE_ADDR DECODE_PID KILL_AFTER_S
(KILL_AFTER_S < 0: no kill). Used by run.sh (docs/protocol.md, "UCX protocols").
"""
import os
import signal
import sys
import threading
import time

import grpc
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)


def rpc(addr, method):
    channel = grpc.insecure_channel(addr)
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    m = pool.FindMethodByName(method)
    request = message_factory.GetMessageClass(m.input_type)
    response = message_factory.GetMessageClass(m.output_type)
    service, name = method.rsplit(".", 1)
    call = channel.unary_unary(f"/{service}/{name}", request_serializer=request.SerializeToString,
                               response_deserializer=response.FromString)
    return request, call


def main():
    prefill_addr, decode_addr = sys.argv[1], sys.argv[2]
    decode_pid, kill_after = int(sys.argv[3]), float(sys.argv[4])
    Reserve, reserve = rpc(decode_addr, "pdserve.worker.v1.DecodeWorker.Reserve")
    Prefill, prefill = rpc(prefill_addr, "pdserve.worker.v1.PrefillWorker.Prefill")
    prompt = [(i * 37) % 4000 + 5 for i in range(400)]
    r = Reserve(request_id=720001, prompt_tokens=len(prompt), lease_ms=30000,
                prompt_token_ids=prompt)
    r.sampling.temperature = 0
    r.sampling.top_p = 1
    r.sampling.repetition_penalty = 1
    r.sampling.max_tokens = 64
    ticket = reserve(r, timeout=30).ticket
    p = Prefill(request_id=720001, token_ids=prompt)
    # The two stubs' messages come from two descriptor pools: copy through the wire form.
    p.ticket.ParseFromString(ticket.SerializeToString())
    p.sampling.ParseFromString(r.sampling.SerializeToString())
    outcome = {}

    def run():
        try:
            prefill(p, timeout=60)
            outcome["status"] = "OK"
        except grpc.RpcError as e:
            outcome["status"] = f"{e.code().name}: {e.details()}"

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(max(kill_after, 0))
    if kill_after >= 0:
        os.kill(decode_pid, signal.SIGKILL)
    thread.join()
    print("prefill:", outcome["status"])


if __name__ == "__main__":
    main()
