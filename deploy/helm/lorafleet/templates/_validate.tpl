{{/*
Cross-field rules that values.schema.json cannot express (JSON Schema checks each value on its
own: types, ranges, known devices, ports). Each refusal names the values to change; the tests
in tests/kube/test_chart.py run every one through the real helm binary.
*/}}
{{- define "lorafleet.validate" -}}
{{- $a := .Values.agent -}}
{{- if $a.enabled -}}
{{- $tp := int $a.tpSize -}}
{{- $dp := int $a.dpSize -}}
{{- $ep := int $a.epSize -}}
{{- if eq $a.backend "vllm" -}}
{{- include "lorafleet.validateVllm" . -}}
{{- else -}}
{{- if ne (mod $tp $dp) 0 -}}
{{- fail (printf "agent.tpSize (%d) must be divisible by agent.dpSize (%d)" $tp $dp) -}}
{{- end -}}
{{- if ne (mod $tp $ep) 0 -}}
{{- fail (printf "agent.tpSize (%d) must be divisible by agent.epSize (%d)" $tp $ep) -}}
{{- end -}}
{{- if and (eq $a.device "cuda") (ne (int $a.gpus) $tp) -}}
{{- fail (printf "agent.gpus (%d) must equal agent.tpSize (%d) with agent.device=cuda: every rank needs its own GPU" (int $a.gpus) $tp) -}}
{{- end -}}
{{- if and (eq $a.device "cpu") (ne (int $a.gpus) 0) -}}
{{- fail (printf "agent.gpus (%d) must be 0 with agent.device=cpu: the ranks would not use them" (int $a.gpus)) -}}
{{- end -}}
{{- end -}}
{{- if eq (int $a.grpcPort) (int $a.metricsPort) -}}
{{- fail (printf "agent.grpcPort and agent.metricsPort must differ (both %d)" (int $a.grpcPort)) -}}
{{- end -}}
{{- if and $a.http.enabled (has (int $a.http.port) (list (int $a.grpcPort) (int $a.metricsPort))) -}}
{{- fail (printf "agent.http.port (%d) must differ from agent.grpcPort and agent.metricsPort" (int $a.http.port)) -}}
{{- end -}}
{{- if has (int $a.healthPort) (list (int $a.grpcPort) (int $a.metricsPort) (int $a.http.port)) -}}
{{- fail (printf "agent.healthPort (%d) must differ from agent.grpcPort, agent.metricsPort and agent.http.port" (int $a.healthPort)) -}}
{{- end -}}
{{- $m := $a.model -}}
{{- $sources := list -}}
{{- if $m.pvc.claimName }}{{ $sources = append $sources "agent.model.pvc.claimName" }}{{ end -}}
{{- if $m.hostPath.path }}{{ $sources = append $sources "agent.model.hostPath.path" }}{{ end -}}
{{- if $m.download.url }}{{ $sources = append $sources "agent.model.download.url" }}{{ end -}}
{{- if eq (len $sources) 0 -}}
{{- fail "no model source for the agents: set one of agent.model.pvc.claimName (a PVC holding the model directory; agent.model.pvc.subPath for a sub-directory), agent.model.hostPath.path (a directory on every agent node), or agent.model.download.url with agent.model.download.sha256 (an https tar archive of the model directory); see docs/deploy.md, Model" -}}
{{- end -}}
{{- if gt (len $sources) 1 -}}
{{- fail (printf "the agents' model has more than one source (%s): set exactly one" (join ", " $sources)) -}}
{{- end -}}
{{- with $m.pvc.subPath -}}
{{- if or (hasPrefix "/" .) (regexMatch "(^|/)[.][.](/|$)" .) -}}
{{- fail (printf "agent.model.pvc.subPath (%s) must be a relative path inside the claim, without '..'" .) -}}
{{- end -}}
{{- end -}}
{{- if $m.download.url -}}
{{- if not (regexMatch "^[0-9a-f]{64}$" ($m.download.sha256 | toString)) -}}
{{- fail (printf "agent.model.download.sha256 is required with agent.model.download.url: the archive's sha256 as 64 lowercase hex digits (got %q)" ($m.download.sha256 | toString)) -}}
{{- end -}}
{{- if and (hasPrefix "http://" $m.download.url) (not $m.download.allowHttp) -}}
{{- fail "agent.model.download.url is plaintext http://: use https://, or set agent.model.download.allowHttp=true (the sha256 still checks the content)" -}}
{{- end -}}
{{- if not (regexMatch "^https?://[^/@?#]+/[^?#]*$" $m.download.url) -}}
{{- fail "agent.model.download.url must be http(s)://HOST/PATH without credentials, query or fragment (credentials belong in no URL)" -}}
{{- end -}}
{{- end -}}
{{- $src := $a.sources -}}
{{- if and $src.s3WebIdentity.enabled (not (and $src.s3Endpoint $src.s3WebIdentity.roleArn)) -}}
{{- fail "agent.sources.s3WebIdentity.enabled=true needs agent.sources.s3Endpoint (the store) and agent.sources.s3WebIdentity.roleArn (the role the agents assume)" -}}
{{- end -}}
{{- range $src.allowHub -}}
{{- /* The agents fetch hf://ORG/REPO/... from HUB/ORG/REPO/resolve/...: some allow prefix must
       cover the repositories' URLs, or every hf:// load the fleet admits fails on the agents. */ -}}
{{- $base := printf "%s/%s" (trimSuffix "/" $src.hubEndpoint) (trimPrefix "hf://" .) -}}
{{- if not (hasSuffix "/" $base) }}{{ $base = printf "%s/" $base }}{{ end -}}
{{- $covered := false -}}
{{- range $src.allow }}{{ if hasPrefix . $base }}{{ $covered = true }}{{ end }}{{ end -}}
{{- if not $covered -}}
{{- fail (printf "agent.sources.allowHub has %s, but no agent.sources.allow prefix covers its URLs at agent.sources.hubEndpoint (%s): add one such as %s/ (and the file CDN hosts the Hub redirects to), or the agents refuse every hf:// load" . $base (trimSuffix "/" $src.hubEndpoint)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) -}}
{{- fail "tls.enabled=true needs tls.secretName: a Secret with tls.crt, tls.key and ca.crt (docs/deploy.md, TLS)" -}}
{{- end -}}
{{- end -}}


{{/* The rules of agent.backend=vllm: the servers' image, count and ports, and what vLLM's HTTP
     API cannot do (the agents refuse pinned loads). */}}
{{- define "lorafleet.validateVllm" -}}
{{- $a := .Values.agent -}}
{{- $v := $a.vllm -}}
{{- if not (and $v.image $v.tag) -}}
{{- fail "agent.backend=vllm needs agent.vllm.image and agent.vllm.tag: the vLLM OpenAI server image and its version (e.g. vllm/vllm-openai and v0.32.0)" -}}
{{- end -}}
{{- $servers := int $v.servers -}}
{{- if lt $servers 1 -}}
{{- fail (printf "agent.vllm.servers (%d) must be at least 1 with agent.backend=vllm: each server is one rank of the agent" $servers) -}}
{{- end -}}
{{- if .Values.fleet.allowPinning -}}
{{- fail "fleet.allowPinning=true cannot be expressed with agent.backend=vllm: vLLM's HTTP API cannot keep an adapter in a device slot, and the agents refuse pinned loads; set fleet.allowPinning=false" -}}
{{- end -}}
{{- if lt (int $a.maxLoadedLoras) (int $a.maxLorasPerBatch) -}}
{{- fail (printf "agent.maxLoadedLoras (%d) must be at least agent.maxLorasPerBatch (%d) with agent.backend=vllm: they are the servers' --max-cpu-loras and --max-loras" (int $a.maxLoadedLoras) (int $a.maxLorasPerBatch)) -}}
{{- end -}}
{{- $first := int $v.port -}}
{{- $last := add $first $servers -1 -}}
{{- if gt $last 65535 -}}
{{- fail (printf "agent.vllm.port (%d) + agent.vllm.servers (%d) - 1 is over 65535: server i listens on agent.vllm.port + i" $first $servers) -}}
{{- end -}}
{{- $agentPorts := list (int $a.grpcPort) (int $a.metricsPort) (int $a.healthPort) -}}
{{- if $a.http.enabled }}{{ $agentPorts = append $agentPorts (int $a.http.port) }}{{ end -}}
{{- range $agentPorts -}}
{{- if and (ge . $first) (le . $last) -}}
{{- fail (printf "the vLLM servers' ports (agent.vllm.port %d to %d, one per server) must not include the agent's port %d (agent.grpcPort, metricsPort, healthPort or http.port)" $first $last .) -}}
{{- end -}}
{{- end -}}
{{- range $v.extraArgs -}}
{{- if regexMatch "^--(host|port|served[-_]model[-_]name|enable[-_]lora|max[-_]loras|max[-_]lora[-_]rank|max[-_]cpu[-_]loras|tensor[-_]parallel[-_]size)(=|$)" (toString .) -}}
{{- fail (printf "agent.vllm.extraArgs has %s, which the chart sets itself: use agent.vllm.port, agent.baseModel, agent.maxLoraRank, agent.maxLorasPerBatch, agent.maxLoadedLoras or agent.vllm.gpus (the agent's flags come from the same values)" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
