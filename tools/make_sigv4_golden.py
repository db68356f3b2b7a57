#!/usr/bin/env python3
"""Golden AWS Signature V4 Authorization headers from botocore's S3 signer (the reference
implementation the AWS SDKs use), for tests/unit/test_object_store.cpp.

  MOTO_VENV/bin/python tools/make_sigv4_golden.py > tests/data/s3/sigv4_golden.json

Each case: method, host, path (as sent, encoded), query (decoded pairs), payload hash, the
session token if any, the time; botocore signs host, x-amz-content-sha256, x-amz-date (and
x-amz-security-token), as bertrain does.
"""
import datetime
import json
from unittest import mock

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
CASES = [
    dict(method="GET", host="examplebucket.s3.amazonaws.com", path="/test.txt", query=[]),
    dict(method="GET", host="127.0.0.1:9000", path="/data/", query=[["list-type", "2"], ["prefix", "demo/part-"]]),
    dict(method="GET", host="data.s3.us-west-2.amazonaws.com", path="/",
         query=[["list-type", "2"], ["prefix", "a b/c+d"], ["continuation-token", "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM="]]),
    dict(method="GET", host="b.oss-cn-hangzhou.aliyuncs.com", path="/dir/%E6%95%B0%E6%8D%AE%20file%2B1.tfrecord",
         query=[], region="oss-cn-hangzhou"),
    dict(method="HEAD", host="localhost:5000", path="/bucket/key", query=[], token="FQoGZXIvYXdzE//token+/="),
    dict(method="PUT", host="localhost:5000", path="/bucket/out/part-00000-of-00001.tfrecord", query=[],
         payload="hello object"),
]
KEY, SECRET = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
WHEN = datetime.datetime(2026, 11, 30, 12, 34, 56)


def sign(c):
    from urllib.parse import quote
    import hashlib
    region = c.get("region", "us-east-1")
    payload = c.get("payload", "").encode()
    payload_hash = hashlib.sha256(payload).hexdigest() if payload else EMPTY
    qs = "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in c["query"])
    url = f"http://{c['host']}{c['path']}" + (f"?{qs}" if qs else "")
    req = AWSRequest(method=c["method"], url=url, data=payload or None)
    req.headers["x-amz-content-sha256"] = payload_hash
    creds = Credentials(KEY, SECRET, c.get("token"))
    with mock.patch("botocore.auth.get_current_datetime", return_value=WHEN):
        S3SigV4Auth(creds, "s3", region).add_auth(req)
    return {**c, "region": region, "payload_sha256": payload_hash, "amz_date": req.headers["X-Amz-Date"],
            "authorization": req.headers["Authorization"]}


print(json.dumps({"access_key": KEY, "secret_key": SECRET, "cases": [sign(c) for c in CASES]}, indent=1))
