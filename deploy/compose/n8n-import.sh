#!/bin/sh
# One-shot service of the compose stack, in the n8n image, before n8n starts:
# creates the credentials the outbox workflow (deploy/n8n) refers to from this
# service's environment, imports the workflow and publishes it. n8n must not
# be running meanwhile (it would keep stale webhook registrations), hence a
# separate service that n8n waits for. Runs on every `docker compose up`;
# importing the same ids again replaces them.
set -eu

workflow=/import/outbox-workflow.json
credentials=/tmp/outbox-credentials.json

node /import/n8n-credentials.js "$workflow" "$credentials"
if [ "$(node -e 'console.log(JSON.parse(require("fs").readFileSync(process.argv[1], "utf8")).length)' "$credentials")" != 0 ]; then
	n8n import:credentials --input="$credentials"
fi
rm -f "$credentials"

n8n import:workflow --input="$workflow"

# publish:workflow needs the id; the file holds one workflow or an array.
ids=$(node -e '
	const wf = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"));
	for (const w of [].concat(wf)) {
		if (!w.id) { console.error(process.argv[1] + ": a workflow has no \"id\""); process.exit(1); }
		console.log(w.id);
	}
' "$workflow")
for id in $ids; do
	n8n publish:workflow --id="$id"
done
echo "n8n-import: imported and published workflow(s)" $ids
