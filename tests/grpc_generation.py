"""pdserve.v1.Generation from Python without generated code: the request and response classes
are built from the descriptors the router's server reflection returns (grpcio,
grpcio-reflection), so a test exercises the proto the server was built with.
"""
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)


def generation_call(channel):
    """(GenerateRequest class, the server-streaming Generate callable) for `channel`."""
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    method = pool.FindServiceByName("pdserve.v1.Generation").FindMethodByName("Generate")
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    call = channel.unary_stream("/pdserve.v1.Generation/Generate",
                                request_serializer=request_class.SerializeToString,
                                response_deserializer=response_class.FromString)
    return request_class, call


def join_choice(responses):
    """Choice 0 of a Generate stream joined as a client joins it: {"text", "reasoning",
    "tool_calls" (id, name, arguments, index), "finish_reason", "usage" (dict), "messages"}."""
    out = {"text": "", "reasoning": "", "tool_calls": [], "finish_reason": None, "usage": None,
           "messages": 0}
    for response in responses:
        out["messages"] += 1
        for choice in response.choices:
            if choice.index != 0:
                continue
            out["text"] += choice.text
            out["reasoning"] += choice.reasoning
            out["tool_calls"] += [{"id": c.id, "name": c.name, "arguments": c.arguments,
                                   "index": c.index} for c in choice.tool_calls]
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
        if response.HasField("usage"):
            u = response.usage
            out["usage"] = {"prompt_tokens": u.prompt_tokens,
                            "completion_tokens": u.completion_tokens,
                            "reasoning_tokens": u.reasoning_tokens}
    return out
