#!/usr/bin/env python3
"""A TCP proxy in front of an S3 server that adds what a real network and a real store do to
bertrain's requests, for tests/s3 and bench/s3_input.sh. Test tooling only (bertrain itself does
its HTTP through libcurl).

  s3proxy.py --listen PORT [--bind ADDR] --upstream HOST:PORT [--rtt-ms MS] [--faults FILE]

--rtt-ms: every byte waits MS/2 in each direction (and a new connection one MS, its handshake),
  pipelined, so bandwidth stays what it was: the round trip of a distant store. (What tc netem
  on a link would do; this kernel has no netem.)
--faults FILE: a JSON list of rules, read again for every request; each
  {"match": "substring of the request line", "action": "500"|"503"|"cut"|"cut-request"|"reset",
   "times": N}
  answers the next N matching requests with that HTTP status (S3's XML error: InternalError,
  SlowDown), or forwards them and cuts the connection halfway through the reply's body ("cut"),
  or forwards half of the request's body and cuts both connections (an upload cut midway:
  "cut-request"), or closes the connection before any reply ("reset"). Each hit is appended to
  FILE + ".log".
  With --faults every connection carries one request (the proxy reads each request whole).
"""
import argparse
import asyncio
import json
import os
import time

ERRORS = {
    "500": ("500 Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "503": ("503 Slow Down", "SlowDown", "Please reduce your request rate."),
}


async def pipe_delayed(reader, writer, delay):
    """Copies reader to writer, each chunk delivered `delay` seconds after it arrived."""
    q = asyncio.Queue()

    async def pump():
        while True:
            data = await reader.read(1 << 20)
            await q.put((time.monotonic() + delay, data))
            if not data:
                return

    async def deliver():
        while True:
            due, data = await q.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        try:
            writer.write_eof()
        except OSError:
            pass

    await asyncio.gather(pump(), deliver())


async def read_request(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await reader.readexactly(length) if length else b""
    return head, body


def take_fault(path, request_line):
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        rules = json.load(f)
    for r in rules:
        if r.get("times", 0) > 0 and r["match"] in request_line:
            r["times"] -= 1
            with open(path + ".tmp", "w") as f:
                json.dump(rules, f)
            os.replace(path + ".tmp", path)
            with open(path + ".log", "a") as f:
                f.write(f"{r['action']} {request_line}\n")
            return r["action"]
    return None


async def handle(creader, cwriter, args):
    delay = args.rtt_ms / 2000.0
    host, port = args.upstream.split(":")
    try:
        if args.rtt_ms:
            await asyncio.sleep(2 * delay)  # the handshake's round trip
        if not args.faults:
            ureader, uwriter = await asyncio.open_connection(host, int(port))
            await asyncio.gather(pipe_delayed(creader, uwriter, delay),
                                 pipe_delayed(ureader, cwriter, delay))
            return
        head, body = await read_request(creader)
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        action = take_fault(args.faults, line)
        if action in ERRORS:
            status, code, msg = ERRORS[action]
            xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                   f"<Message>{msg}</Message></Error>").encode()
            cwriter.write(f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
                          f"Content-Length: {len(xml)}\r\nConnection: close\r\n\r\n".encode() + xml)
            await cwriter.drain()
            return
        if action == "reset":
            return
        # One request per connection: the upstream closes after its reply.
        head = head[:-2] + b"Connection: close\r\n\r\n"
        ureader, uwriter = await asyncio.open_connection(host, int(port))
        if action == "cut-request":
            uwriter.write(head + body[: len(body) // 2])
            await uwriter.drain()
            uwriter.close()
            return
        uwriter.write(head + body)
        await uwriter.drain()
        if action == "cut":
            rhead = await ureader.readuntil(b"\r\n\r\n")
            length = 0
            for l in rhead.split(b"\r\n"):
                if l.lower().startswith(b"content-length:"):
                    length = int(l.split(b":", 1)[1])
            part = await ureader.readexactly(length // 2)
            cwriter.write(rhead + part)
            await cwriter.drain()
            uwriter.close()
            return
        while True:
            data = await ureader.read(1 << 20)
            if not data:
                break
            cwriter.write(data)
            await cwriter.drain()
        uwriter.close()
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        pass
    finally:
        cwriter.close()


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", type=int, required=True)
    ap.add_argument("--bind", default="127.0.0.1", help="the address to listen on")
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--rtt-ms", type=float, default=0)
    ap.add_argument("--faults", default="")
    args = ap.parse_args()
    server = await asyncio.start_server(lambda r, w: handle(r, w, args), args.bind, args.listen)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
