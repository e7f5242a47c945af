"""Schemas for the custom resources in deploy/k8s, which kubernetes-validate does not know:
the Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1) and KEDA's ScaledObject
(keda.sh/v1alpha1).

Written here from the fields, types and required lists their CRDs define (prometheus-operator's
`monitoring.coreos.com_servicemonitors.yaml`, KEDA's `keda.sh_scaledobjects.yaml` and its
ScaledObject specification), for the parts of them that deploy/k8s uses or may well use. They
are stricter than the CRDs: every object refuses a field it does not list (as the API server
prunes or, with strict field validation, refuses an unknown one), so a misspelt or misplaced
field fails here, and a real field not listed must be added here before it is used.
"""

from typing import Any

import jsonschema

Schema = dict[str, Any]


def obj(required: list[str] | None = None, **properties: Schema) -> Schema:
    """A closed object: the listed properties only."""
    return {"type": "object", "properties": properties, "required": required or [],
            "additionalProperties": False}


def array(items: Schema) -> Schema:
    return {"type": "array", "items": items}


STRING: Schema = {"type": "string"}
INT32: Schema = {"type": "integer", "minimum": -(2 ** 31), "maximum": 2 ** 31 - 1}
BOOL: Schema = {"type": "boolean"}
STRING_MAP: Schema = {"type": "object", "additionalProperties": STRING}
DURATION: Schema = {"type": "string", "pattern": (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$")}
METADATA = obj(["name"], name=STRING, namespace=STRING, labels=STRING_MAP,
               annotations=STRING_MAP)
LABEL_SELECTOR = obj(
    matchLabels=STRING_MAP,
    matchExpressions=array(obj(["key", "operator"], key=STRING, values=array(STRING),
                               operator={"enum": ["In", "NotIn", "Exists", "DoesNotExist"]})))
SECRET_KEY = obj(["key"], name=STRING, key=STRING, optional=BOOL)


def resource(api_version: str, kind: str, spec: Schema) -> Schema:
    return obj(["apiVersion", "kind", "metadata", "spec"], apiVersion={"const": api_version},
               kind={"const": kind}, metadata=METADATA, spec=spec)


SERVICE_MONITOR = resource("monitoring.coreos.com/v1", "ServiceMonitor", obj(
    ["endpoints", "selector"],
    selector=LABEL_SELECTOR,
    namespaceSelector=obj(any=BOOL, matchNames=array(STRING)),
    jobLabel=STRING, targetLabels=array(STRING), podTargetLabels=array(STRING),
    sampleLimit={"type": "integer", "minimum": 0},
    endpoints=array(obj(
        port=STRING, targetPort={"type": ["string", "integer"]}, path=STRING,
        scheme={"enum": ["http", "https", "HTTP", "HTTPS"]}, interval=DURATION,
        scrapeTimeout=DURATION, honorLabels=BOOL, honorTimestamps=BOOL,
        params={"type": "object", "additionalProperties": array(STRING)},
        authorization=obj(type=STRING, credentials=SECRET_KEY),
        bearerTokenSecret=SECRET_KEY)),
))

HPA_RULES = obj(
    stabilizationWindowSeconds={"type": "integer", "minimum": 0, "maximum": 3600},
    selectPolicy={"enum": ["Max", "Min", "Disabled"]},
    policies=array(obj(["type", "value", "periodSeconds"], type={"enum": ["Pods", "Percent"]},
                       value={"type": "integer", "minimum": 1},
                       periodSeconds={"type": "integer", "minimum": 1, "maximum": 1800})))

SCALED_OBJECT = resource("keda.sh/v1alpha1", "ScaledObject", obj(
    ["scaleTargetRef", "triggers"],
    scaleTargetRef=obj(["name"], apiVersion=STRING, kind=STRING, name=STRING,
                       envSourceContainerName=STRING),
    pollingInterval=INT32, cooldownPeriod=INT32, initialCooldownPeriod=INT32,
    idleReplicaCount=INT32, minReplicaCount=INT32, maxReplicaCount=INT32,
    fallback=obj(["failureThreshold", "replicas"], failureThreshold=INT32, replicas=INT32),
    advanced=obj(
        restoreToOriginalReplicaCount=BOOL,
        horizontalPodAutoscalerConfig=obj(
            name=STRING, behavior=obj(scaleUp=HPA_RULES, scaleDown=HPA_RULES))),
    triggers={**array(obj(
        ["type", "metadata"], type=STRING, name=STRING, metadata=STRING_MAP,
        metricType={"enum": ["AverageValue", "Value", "Utilization"]},
        useCachedMetrics=BOOL, authenticationRef=obj(["name"], name=STRING, kind=STRING))),
        "minItems": 1},
))

SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
           ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT}


def is_custom(doc: dict[str, Any]) -> bool:
    return (doc.get("apiVersion"), doc.get("kind")) in SCHEMAS


def validate(doc: dict[str, Any]) -> None:
    """Raises jsonschema.ValidationError (its message and path name the field)."""
    schema = SCHEMAS[(doc["apiVersion"], doc["kind"])]
    jsonschema.Draft202012Validator(schema).validate(doc)
