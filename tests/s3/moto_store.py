#!/usr/bin/env python3
"""The S3 side of tests/s3 and bench/s3_input.sh, with boto3 against a moto server (moto checks
SigV4 once IAM is on: the server starts with INITIAL_NO_AUTH_ACTION_COUNT=3, the three IAM calls
of `setup`).

  moto_store.py setup ENDPOINT BUCKET      -> prints "ACCESS_KEY SECRET_KEY" of a new IAM user
  moto_store.py put ENDPOINT BUCKET PREFIX FILE...   (keys PREFIX + basename; env keys)
  moto_store.py fill ENDPOINT BUCKET PREFIX N        (N empty objects PREFIX00000..: pagination)
  moto_store.py get ENDPOINT BUCKET KEY OUT
  moto_store.py check-run ENDPOINT BUCKET PREFIX   (a run directory bertrain published: every
      checkpoint with a COMMIT has each file it names, of its size and SHA-256; prints
      "latest NAME committed N objects M orphans K", the orphans being checkpoint objects of no
      committed checkpoint; exit 1 on a mismatch)
"""
import hashlib
import json
import os
import sys

import boto3


def client(endpoint, service="s3", **keys):
    return boto3.client(service, endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=keys.get("ak", os.environ.get("AWS_ACCESS_KEY_ID", "x")),
                        aws_secret_access_key=keys.get("sk", os.environ.get("AWS_SECRET_ACCESS_KEY", "x")))


def main():
    cmd, endpoint, bucket = sys.argv[1:4]
    if cmd == "setup":
        iam = client(endpoint, "iam")
        iam.create_user(UserName="bertrain")
        iam.put_user_policy(UserName="bertrain", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        k = iam.create_access_key(UserName="bertrain")["AccessKey"]
        client(endpoint, ak=k["AccessKeyId"], sk=k["SecretAccessKey"]).create_bucket(Bucket=bucket)
        print(k["AccessKeyId"], k["SecretAccessKey"])
    elif cmd == "put":
        prefix = sys.argv[4]
        s3 = client(endpoint)
        for f in sys.argv[5:]:
            s3.upload_file(f, bucket, prefix + os.path.basename(f))
    elif cmd == "fill":
        prefix, n = sys.argv[4], int(sys.argv[5])
        s3 = client(endpoint)
        for i in range(n):
            s3.put_object(Bucket=bucket, Key=f"{prefix}{i:05d}", Body=b"")
    elif cmd == "get":
        client(endpoint).download_file(bucket, sys.argv[4], sys.argv[5])
    elif cmd == "check-run":
        prefix = sys.argv[4].rstrip("/") + "/"
        s3 = client(endpoint)
        keys = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
        commits = sorted(k for k in keys if k.endswith("/COMMIT"))
        named = set(commits)
        for c in commits:
            commit = json.loads(s3.get_object(Bucket=bucket, Key=c)["Body"].read())
            base = c[: -len("COMMIT")]
            for f in commit["files"]:
                body = s3.get_object(Bucket=bucket, Key=base + f["name"])["Body"].read()
                if len(body) != f["size"] or hashlib.sha256(body).hexdigest() != f["sha256"]:
                    sys.exit(f"{base + f['name']}: {len(body)} bytes, not the {f['size']} its COMMIT names")
                named.add(base + f["name"])
        orphans = [k for k in keys if "/checkpoint-" in k and k not in named]
        latest = s3.get_object(Bucket=bucket, Key=prefix + "latest")["Body"].read().decode().strip() \
            if prefix + "latest" in keys else "-"
        if latest != "-" and prefix + latest + "/COMMIT" not in commits:
            sys.exit(f"latest names {latest}, which has no COMMIT")
        print(f"latest {latest} committed {len(commits)} objects {len(keys)} orphans {len(orphans)}")
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
