from django.apps import AppConfig


class OrdersConfig(AppConfig):
    name = "tests.django_project.orders"
    label = "orders"
