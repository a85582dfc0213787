// Splits a DeepSeek-V4 chat answer, as it streams out of the detokenizer, into reasoning, answer
// text and tool calls (parse_message_from_completion_text of encoding/encoding_dsv4.py, made
// incremental and tolerant):
//
//   [reasoning </think>] content ["\n\n<｜DSML｜tool_calls>\n" invoke* "</｜DSML｜tool_calls>"]
//   invoke = <｜DSML｜invoke name="NAME">\n
//            (<｜DSML｜parameter name="K" string="true|false">VALUE</｜DSML｜parameter>\n)*
//            </｜DSML｜invoke>\n       (no parameters: an empty line before </｜DSML｜invoke>)
//
// Text may arrive in any pieces: a marker split across pieces (or inside one token's text) is
// held back until it is decided. A block's tool calls are released together when the block is
// whole (its closing tag read), each with its arguments as a JSON object text in the module's
// layout ({"K": "string", "N": 5}; a string="false" value must itself be JSON). A block that is
// not whole counts not at all: malformed tool-call text (a broken tag, a value that is not JSON,
// a duplicate parameter) or a block cut off by the end of the answer (max_tokens, or an EOS
// before the closing tag) is released as content from the block's opening tag, complete invokes
// included, and so is the rest of the answer. So a call is never returned from an answer cut
// inside its block (docs/chat-format.md), and the pieces' concatenation never depends on how
// the text was split.
//
// Thread-safety: one parser per choice, used by one thread at a time.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace pdserve::text {

struct ParsedToolCall {
  std::string name;
  std::string arguments;  // JSON object text
};

// What one Add() or Finish() released.
struct ChatOutputPiece {
  std::string reasoning;
  std::string content;
  std::vector<ParsedToolCall> tool_calls;
};

struct ChatOutputOptions {
  bool thinking = false;  // the answer opens inside its reasoning (the prompt ended with <think>)
  bool tools = false;     // parse DSML tool-call blocks; otherwise they stay content
  std::string think_end = "</think>";
  std::string dsml = "｜DSML｜";
};

class ChatOutputParser {
 public:
  explicit ChatOutputParser(ChatOutputOptions options);

  // Consumes the next piece of answer text.
  ChatOutputPiece Add(std::string_view text);
  // The answer ended: releases what was held back (an unfinished tool-call block as content).
  ChatOutputPiece Finish();

  // True while the text read so far is reasoning (no </think> yet).
  bool in_reasoning() const { return state_ == State::kReasoning; }

 private:
  enum class State { kReasoning, kContent, kToolBlock };
  // Moves what is decided out of pending_ into `piece`; `at_end`: nothing more will come.
  void Drain(bool at_end, ChatOutputPiece& piece);
  // One step inside a tool-call block; false when it needs more text.
  bool StepToolBlock(bool at_end, ChatOutputPiece& piece);
  // The block went wrong: its unreleased text becomes content.
  void Malformed(ChatOutputPiece& piece);

  ChatOutputOptions options_;
  std::string block_start_;  // "\n\n<｜DSML｜tool_calls"
  State state_;
  std::string pending_;  // text not yet released
  // Text of the current tool-call block read so far (its opening tag and complete invokes):
  // content again if the block turns out malformed or is cut off.
  std::string block_raw_;
  std::vector<ParsedToolCall> block_calls_;  // its complete invokes, released when it closes
  bool block_header_read_ = false;
  bool tools_off_ = false;  // a block was malformed: the rest of the answer is content
};

}  // namespace pdserve::text
