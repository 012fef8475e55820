"""Chat with a running `inference` server from the terminal (a quick look at what a policy says).

    uv run python scripts/chat.py [--url http://127.0.0.1:8000] [--temperature 0.7] [--max-tokens 256]

Type a message and press enter; `/reset` clears the history, `/quit` (or Ctrl-D) leaves. The API key,
if the server has one, is read from the OPENAI_API_KEY environment variable.
"""

import argparse
import os

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    key = os.environ.get("OPENAI_API_KEY")
    client = httpx.Client(base_url=args.url, timeout=600, headers={"Authorization": f"Bearer {key}"} if key else {})
    model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
    print(f"chatting with {model} at {args.url}")
    history: list[dict] = []
    while True:
        try:
            text = input("> ")
        except EOFError:
            break
        if text.strip() == "/quit":
            break
        if text.strip() == "/reset":
            history.clear()
            continue
        history.append({"role": "user", "content": text})
        body = {"model": model, "messages": history, "temperature": args.temperature, "max_tokens": args.max_tokens}
        reply = client.post("/v1/chat/completions", json=body).raise_for_status().json()["choices"][0]["message"]
        history.append({"role": "assistant", "content": reply["content"]})
        print(reply["content"])


if __name__ == "__main__":
    main()
