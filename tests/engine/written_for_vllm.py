"""A program written for vLLM's offline API, as vLLM's quickstart and examples write one:
``tests/engine/test_vllm_program.py`` runs it with its vLLM import swapped for pagedserve's and nothing
else changed. It prints one JSON line of what it read from the outputs."""

import json
import sys

from vllm import LLM, SamplingParams


def main(model: str) -> None:
    llm = LLM(model=model, seed=0, max_model_len=1024)
    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=12, logprobs=3, seed=7)
    report = {"generate": []}
    for output in llm.generate(prompts, sampling_params):
        for completion in output.outputs:
            positions = []
            for token_id, logprobs in zip(completion.token_ids, completion.logprobs):
                chosen = logprobs[token_id]
                positions.append({"logprob": chosen.logprob, "rank": chosen.rank, "text": chosen.decoded_token,
                                  "ranks": [lp.rank for lp in logprobs.values()],
                                  "best": max(lp.logprob for lp in logprobs.values())})
            report["generate"].append({"prompt": output.prompt, "prompt_tokens": len(output.prompt_token_ids),
                                       "index": completion.index, "text": completion.text,
                                       "tokens": len(completion.token_ids), "finish_reason": completion.finish_reason,
                                       "cumulative_logprob": completion.cumulative_logprob, "positions": positions})
    scored = llm.generate("Paged attention keeps the cache in blocks",
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    report["prompt_logprobs"] = [None if entry is None else {"logprob": entry[token].logprob, "rank": entry[token].rank,
                                                             "entries": len(entry)}
                                 for token, entry in zip(scored.prompt_token_ids, scored.prompt_logprobs)]
    ids = llm.get_tokenizer().encode("One, two, three, four,", add_special_tokens=False)
    as_tokens = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4))[0]
    report["tokens_prompt"] = {"prompt_token_ids": as_tokens.prompt_token_ids, "ids": ids, "prompt": as_tokens.prompt}
    stopped = llm.generate([{"prompt": "One, two, three, four,"}], SamplingParams(temperature=0, max_tokens=24, stop=[" six"]))
    completion = stopped[0].outputs[0]
    report["stop"] = {"text": completion.text, "finish_reason": completion.finish_reason,
                      "stop_reason": completion.stop_reason}
    chat = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=8))[0]
    report["chat"] = {"prompt": chat.prompt, "text": chat.outputs[0].text}
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
